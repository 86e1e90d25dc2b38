"""Suffix decoding (SuffixDecoding, Oliaro et al. 2025; Arctic Inference's `suffix`): draft from
what earlier requests produced, and from the row's own prompt and output.

Agents, batch pipelines and tools send the same kinds of requests again and again, and their
answers repeat each other more than they repeat their own prompt. So a process keeps one
`SuffixCache`: the outputs of its last finished requests (each after the last few tokens of its
prompt, so the first tokens of an answer have a context to match), bounded by the tokens it
keeps, the oldest evicted first, shared by every row of the process. Each row also has a store of
its own prompt and committed output, and the rows in flight see each other's (n samples of one
prompt draft from each other while they run).

Each step, per row: the suffixes of the row's context (up to `max_depth` tokens) that occur in
those stores, and per match length a tree of what followed the occurrences, grown best first by
observed frequency (a node's score is the product of count ratios along its path) while a node
scores at least `min_prob`, up to `alpha` x the match length nodes; the tree with the highest sum
of scores is offered (kernels/suffix_store.cpp states the rule). The scores are the source's own
estimates of each path's odds; the policy calibrates them. Guesses are deterministic, so
verification keeps greedy and sampled output exact (verify.py).

The stores are native (kernels/suffix_store.cpp, built once per machine with the kernels' builder,
loaded with ctypes): ~21 MB per million cached tokens and ~40-80 us a draft with a million cached
(docs/design.md, "Suffix decoding", says why this and not Arctic Inference or Python).
`SuffixCache.save` / `load` keep the cache across restarts, refused when the tokenizer differs.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
from array import array
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..tree import best_nodes, depths, prune
from ..types import SpecdecError
from .base import Draft, DraftContext, Drafter, Offer

SOURCE = Path(__file__).resolve().parent.parent / "kernels" / "suffix_store.cpp"
FILE_FORMAT = "specdec-suffix-cache"
FILE_VERSION = 1
PROMPT_TAIL = 4  # prompt tokens kept before each output in the cache: the context its first tokens follow
KEY_CAP = 16  # Offer.key: the match length, capped (longer matches are learnt together)

_native_lock = threading.Lock()  # loading the store library
_shared_lock = threading.Lock()  # making the process cache (which loads the library: its own lock)
_state: dict = {}


def _native():
    """The loaded store library (ctypes); SpecdecError saying why where it cannot be built."""
    with _native_lock:
        if "lib" in _state:
            return _state["lib"]
        if "why" in _state:
            raise SpecdecError(_state["why"])
        from ..kernels import _build
        from ..models.loader import cache_root

        try:
            path = _build(cache_root() / "kernels", True, SOURCE, [], "the suffix-decoding store")
            lib = ctypes.CDLL(str(path))
        except (RuntimeError, OSError) as e:
            _state["why"] = f"suffix decoding needs its native store, which could not be built or loaded ({e})"
            raise SpecdecError(_state["why"]) from None
        vp, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.sd_new.restype = vp
        lib.sd_free.argtypes = [vp]
        lib.sd_append.argtypes = [vp, vp, i64]
        for name in ("sd_evict_oldest", "sd_tokens", "sd_sequences", "sd_bytes", "sd_open", "sd_export_size"):
            getattr(lib, name).argtypes = [vp]
            getattr(lib, name).restype = i64
        lib.sd_export.argtypes = [vp, vp]
        lib.sd_speculate.argtypes = [ctypes.POINTER(vp), ctypes.c_int, ctypes.c_int, vp, ctypes.c_int,
                                     ctypes.POINTER(_CParams), ctypes.POINTER(_CResult)]
        lib.sd_speculate.restype = None
        _state["lib"] = lib
        return lib


MAX_NODES = 64  # suffix_store.cpp's MAX_NODES: the most nodes one draft may have


class _CParams(ctypes.Structure):
    _fields_ = [("max_depth", ctypes.c_int32), ("max_nodes", ctypes.c_int32), ("alpha", ctypes.c_double),
                ("offset", ctypes.c_double), ("min_prob", ctypes.c_double), ("max_walk", ctypes.c_int32),
                ("max_occ", ctypes.c_int32), ("lengths", ctypes.c_int32), ("tree", ctypes.c_int32)]


class _CResult(ctypes.Structure):
    _fields_ = [("count", ctypes.c_int32), ("match_len", ctypes.c_int32), ("occurrences", ctypes.c_int32),
                ("tokens", ctypes.c_int32 * MAX_NODES), ("parents", ctypes.c_int32 * MAX_NODES),
                ("probs", ctypes.c_double * MAX_NODES)]


class TokenStore:
    """Token sequences one after another, indexed for suffix matches (kernels/suffix_store.cpp):
    a row's own context (one open sequence that grows) or the cache of finished requests (closed
    sequences, the oldest evicted first)."""

    def __init__(self) -> None:
        self._lib = _native()
        self.handle = ctypes.c_void_p(self._lib.sd_new())

    def __del__(self) -> None:
        if getattr(self, "handle", None) is not None and self.handle.value:
            self._lib.sd_free(self.handle)
            self.handle = None

    def append(self, tokens) -> None:
        """Append to the open sequence (opening one); a -1 among them closes it."""
        if isinstance(tokens, np.ndarray):
            buf = np.ascontiguousarray(tokens, dtype=np.int32)
            address, n = buf.ctypes.data, buf.size
        else:  # a list: an array("i") is made ~10x faster than a numpy or ctypes array
            buf = array("i", tokens)
            address, n = buf.buffer_info()
        if n:
            self._lib.sd_append(self.handle, address, n)

    def close(self) -> None:
        """Close the open sequence (nothing if none is open)."""
        self.append([-1])

    def evict_oldest(self) -> int:
        """Drop the oldest sequence; its token count (-1: none, or only the open one is left)."""
        return self._lib.sd_evict_oldest(self.handle)

    @property
    def tokens(self) -> int:
        return self._lib.sd_tokens(self.handle)

    @property
    def sequences(self) -> int:
        return self._lib.sd_sequences(self.handle)

    @property
    def memory_bytes(self) -> int:
        """Bytes the store holds (its arrays' capacities and its bigram table)."""
        return self._lib.sd_bytes(self.handle)

    def export(self) -> np.ndarray:
        """The live sequences as `append` takes them (each closed one followed by -1), int32."""
        out = np.empty(self._lib.sd_export_size(self.handle), dtype=np.int32)
        if out.size:
            self._lib.sd_export(self.handle, out.ctypes.data)
        return out


@dataclass(frozen=True)
class SuffixParams:
    """How a suffix draft is made (kernels/suffix_store.cpp says the rule).

    max_depth: longest context suffix matched; max_nodes: most nodes a draft has; alpha, offset:
    at most alpha x match length + offset nodes; min_prob: the least path score a node may have;
    tree: a tree (False: the best path only); max_walk: occurrences of the context's last two
    tokens examined per store, newest first; max_occ: the newest matches a tree reads; lengths:
    trees tried from the longest distinct match lengths (the highest sum of scores wins)."""

    max_depth: int = 64
    max_nodes: int = 24
    alpha: float = 2.0
    offset: float = 0.0
    min_prob: float = 0.1
    tree: bool = True
    max_walk: int = 1024
    max_occ: int = 256
    lengths: int = 8

    def __post_init__(self) -> None:
        if not (2 <= self.max_depth and 0 <= self.max_nodes <= MAX_NODES and self.max_walk >= 1 and self.max_occ >= 1
                and self.lengths >= 1):
            raise ValueError(f"suffix settings need max_depth >= 2, 0 <= max_nodes <= {MAX_NODES}, max_walk, max_occ "
                             f"and lengths >= 1; got {self}")
        native = _CParams(self.max_depth, self.max_nodes, self.alpha, self.offset, self.min_prob, self.max_walk,
                          self.max_occ, self.lengths, int(self.tree))
        object.__setattr__(self, "native", native)  # the C struct sd_speculate reads, made once


@dataclass
class SuffixDraft:
    """A draft: tokens, parents (0 = the pending token, else the 1-based node), per node its path
    score; the matched suffix's length and the occurrences the tree was read from."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    match_len: int = 0
    occurrences: int = 0

    @property
    def score(self) -> float:
        """Expected accepted guesses if the scores hold (the sum of path scores)."""
        return float(sum(self.scores))


def speculate(stores: list[TokenStore], context, params: SuffixParams, own: int = 0) -> SuffixDraft:
    """The draft for `context` (its last token is the pending one) from `stores` pooled, or from
    the first `own` of them alone where that scores higher (a row's own store: a big cache's counts
    would dilute what the row itself repeats)."""
    if not stores or not context:
        return SuffixDraft()
    tail = array("i", context[-params.max_depth:])
    handles = (ctypes.c_void_p * len(stores))(*[s.handle.value for s in stores])
    out = _CResult()
    stores[0]._lib.sd_speculate(handles, len(stores), own, tail.buffer_info()[0], len(tail),
                                ctypes.byref(params.native), ctypes.byref(out))
    n = out.count
    return SuffixDraft(out.tokens[:n], out.parents[:n], out.probs[:n], out.match_len, out.occurrences)


class SuffixCache:
    """What a process keeps of its finished requests for suffix decoding: each request's output
    (after the last PROMPT_TAIL tokens of its prompt, or its whole prompt with prompts=True), at
    most `max_tokens` tokens and `max_requests` requests (None: no count limit), the oldest
    evicted first. Thread-safe: inserts, drafts and saves take one lock."""

    def __init__(self, max_tokens: int = 1 << 20, max_requests: int | None = None, prompts: bool = False) -> None:
        if max_tokens < 1 or (max_requests is not None and max_requests < 1):
            raise ValueError(f"a suffix cache needs max_tokens >= 1 and max_requests >= 1 or None, got "
                             f"{max_tokens}, {max_requests}")
        self.max_tokens, self.max_requests, self.prompts = max_tokens, max_requests, prompts
        self.store = TokenStore()
        self.lock = threading.Lock()

    @property
    def tokens(self) -> int:
        return self.store.tokens

    @property
    def requests(self) -> int:
        return self.store.sequences

    @property
    def memory_bytes(self) -> int:
        return self.store.memory_bytes

    def insert(self, prompt: list[int], output: list[int]) -> None:
        """A finished request: keep its output (with its prompt's tail, or whole prompt) and evict
        the oldest requests beyond the bounds."""
        if not output:
            return
        head = list(prompt) if self.prompts else list(prompt[-PROMPT_TAIL:])
        with self.lock:
            self.store.append(head + list(output) + [-1])
            self._evict()

    def clear(self) -> None:
        """Forget every request kept."""
        with self.lock:
            self.store = TokenStore()

    def _evict(self) -> None:
        store = self.store
        while store.sequences > 1 and (store.tokens > self.max_tokens or
                                       (self.max_requests is not None and store.sequences > self.max_requests)):
            store.evict_oldest()
        if store.tokens > self.max_tokens:  # one request longer than the whole bound
            store.evict_oldest()

    def save(self, path, tokenizer_hash: str) -> None:
        """Write the cache to `path` (atomically: a temporary file renamed), for a tokenizer
        `tokenizer_hash` names (the fingerprint the model's tokenizer has)."""
        path = Path(path)
        with self.lock:
            values = self.store.export()
        header = {"format": FILE_FORMAT, "version": FILE_VERSION, "tokenizer": str(tokenizer_hash),
                  "requests": self.requests, "values": int(values.size)}
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write((json.dumps(header) + "\n").encode())
            f.write(values.astype("<i4").tobytes())
        os.replace(tmp, path)

    def load(self, path, tokenizer_hash: str) -> int:
        """Replace the cache by the one saved in `path`; the number of requests loaded (0 if the
        file does not exist yet: the first run makes it). SpecdecError, in one line, if the file
        was saved for another tokenizer or is not a suffix cache. The bounds of this cache apply
        (the oldest requests beyond them are dropped)."""
        path = Path(path)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return 0
        except OSError as e:
            raise SpecdecError(f"cannot read the suffix cache {path}: {e.strerror or e}") from None
        newline = data.find(b"\n")
        try:
            header = json.loads(data[:newline]) if newline > 0 else None
        except ValueError:
            header = None
        if not isinstance(header, dict) or header.get("format") != FILE_FORMAT:
            raise SpecdecError(f"{path} is not a specdec suffix cache; delete it or name another file")
        if header.get("version") != FILE_VERSION:
            raise SpecdecError(f"{path} is a suffix cache of format version {header.get('version')}, this specdec "
                               f"reads version {FILE_VERSION}; delete it to start a new one")
        if header.get("tokenizer") != str(tokenizer_hash):
            raise SpecdecError(f"the suffix cache {path} was saved for tokenizer {header.get('tokenizer')}, but this "
                               f"model's tokenizer is {tokenizer_hash}; delete the file or name another one")
        body = data[newline + 1:]
        count = header.get("values")
        values = np.frombuffer(body, dtype="<i4") if len(body) % 4 == 0 else None
        if not isinstance(count, int) or values is None or values.size != count or (count and values.min() < -1):
            raise SpecdecError(f"the suffix cache {path} is cut short or damaged ({len(body)} bytes of tokens, the "
                               f"header says {count} values); delete it to start a new one")
        store = TokenStore()
        store.append(values)
        store.close()
        with self.lock:
            self.store = store
            self._evict()
            return self.store.sequences


_shared: SuffixCache | None = None


def shared_cache() -> SuffixCache:
    """The process's cache (made with the default bounds on first use): every suffix drafter of
    the process drafts from it and adds to it unless given another."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = SuffixCache()
        return _shared


def forget_shared() -> None:
    """Empty the process's cache (if made). Measurements call it before each timed request, so
    that a repeat of a prompt, or the same prompt under another method, cannot draft from the
    answer an earlier call gave it: each request is timed as a newcomer would be."""
    with _shared_lock:
        if _shared is not None:
            _shared.clear()


class SuffixDrafter(Drafter):
    """The `suffix` draft source: a known source (its guesses cost ~nothing and come before the
    step is priced), one offer per row and step from the row's own store, the other rows' and the
    process cache (`offer`, a tree cut to its best `max_tokens` nodes by score); `propose` gives
    the same drafts as one proposal. A finished row's output goes into the cache (`finish_row`)."""

    name = "suffix"
    known = True

    def __init__(self, cache: SuffixCache | None = None, params: SuffixParams = SuffixParams()) -> None:
        self.cache = cache if cache is not None else shared_cache()
        self.params = params
        self.rows: list[_Row] = []

    def begin(self, prompts, params, max_len) -> None:
        self.rows = []
        for p in prompts:
            self.add_row(max_len, p)

    def join(self, row) -> None:
        """A row joins (issue 51's RowInfo: its prompt)."""
        self.add_row(row.max_len, row.prompt)

    def add_row(self, max_len, prompt=None) -> None:
        self.rows.append(_Row(list(prompt or [])))

    def keep_rows(self, rows) -> None:
        self.rows = [self.rows[r] for r in rows]

    def finish_row(self, row: int, tokens: list[int]) -> None:
        """Row `row` ends with `tokens` (its prompt + output as committed): its output joins the cache."""
        state = self.rows[row]
        self.cache.insert(tokens[:state.prompt_len], tokens[state.prompt_len:])

    def offer(self, ctx: DraftContext, max_tokens: int) -> list[Offer | None]:
        """Per row the draft it could verify now, at most `max_tokens` nodes (None: no suffix of
        its context occurs)."""
        for state, tokens in zip(self.rows, ctx.tokens):
            state.sync(tokens)
        out = []
        rooms = ctx.room or [None] * len(ctx.tokens)
        with self.cache.lock:
            for b, (tokens, room) in enumerate(zip(ctx.tokens, rooms)):
                stores = [self.rows[b].store] + [r.store for i, r in enumerate(self.rows) if i != b] + [self.cache.store]
                draft = speculate(stores, tokens, self.params, own=1)
                if room is not None:
                    draft = _within(draft, room)
                draft = _best(draft, max_tokens)
                out.append(Offer(draft.tokens, draft.parents if self.params.tree else None,
                                 min(draft.match_len, KEY_CAP), draft.scores) if draft.tokens else None)
        return out

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        """The offers as one tree proposal (each cut to its best `max_tokens` nodes)."""
        offers = self.offer(ctx, max_tokens)
        if not self.params.tree:
            return Draft.chains([o.tokens if o else [] for o in offers])
        B = len(offers)
        trees = [(o.tokens, o.parents) if o else ([], []) for o in offers]
        N = max((len(t) for t, _ in trees), default=0)
        tokens = torch.zeros(B, N, dtype=torch.long)
        parents = torch.zeros(B, N, dtype=torch.long)
        for b, (t, p) in enumerate(trees):
            tokens[b, :len(t)] = torch.tensor(t, dtype=torch.long)
            parents[b, :len(p)] = torch.tensor(p, dtype=torch.long)
        counts = torch.tensor([len(t) for t, _ in trees], dtype=torch.long)
        return Draft(tokens, counts, None, parents if self.params.tree else None)

    def commit(self, num_accepted, paths=None) -> None:
        """Nothing to learn here: the committed tokens reach the row's store at the next offer."""


class _Row:
    """A row's own store: its prompt and committed output (the pending token last), appended as
    they come; rebuilt if the row's tokens stop extending what it holds."""

    CHECK = 8  # tokens compared at the end of what the store holds

    def __init__(self, prompt: list[int]) -> None:
        self.prompt_len = len(prompt)
        self.store = TokenStore()
        self.held: list[int] = []  # the store's last CHECK tokens
        self.count = 0
        self.sync(prompt)

    def sync(self, tokens: list[int]) -> None:
        n = self.count
        if len(tokens) < n or tokens[max(0, n - self.CHECK):n] != self.held:
            self.store, self.count, n = TokenStore(), 0, 0
        if len(tokens) > n:
            self.store.append(tokens[n:])
            self.count = len(tokens)
            self.held = list(tokens[max(0, self.count - self.CHECK):])


def _within(draft: SuffixDraft, room: int) -> SuffixDraft:
    """The draft less the nodes deeper than `room` (a row that may take only `room` more tokens)."""
    keep = [i for i, d in enumerate(depths(draft.parents)[1:], start=1) if d <= room]
    if len(keep) == len(draft.tokens):
        return draft
    tokens, parents = prune(draft.tokens, draft.parents, keep)  # a kept node's parent is shallower: kept
    return SuffixDraft(tokens, parents, [draft.scores[i - 1] for i in keep], draft.match_len, draft.occurrences)


def tokenizer_hash(tokenizer) -> str:
    """A fingerprint of a tokenizer's vocabulary (what a saved cache's token ids mean)."""
    import hashlib

    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def load_cache(path, tokenizer, quiet: bool = True) -> int:
    """The process cache (`shared_cache`) from the file `path` (--suffix-cache), for this tokenizer;
    the requests loaded (0: no file yet, the first run makes it)."""
    n = shared_cache().load(path, tokenizer_hash(tokenizer))
    if n and not quiet:
        print(f"[specdec] suffix cache: {n} earlier answers from {path}", file=sys.stderr)
    return n


def save_cache(path, tokenizer) -> None:
    """The process cache into the file `path` (--suffix-cache), for the next run."""
    shared_cache().save(path, tokenizer_hash(tokenizer))


def _best(draft: SuffixDraft, n: int) -> SuffixDraft:
    """The draft cut to its `n` best nodes by score (a node never outscores its parent: kept too)."""
    if len(draft.tokens) <= n:
        return draft
    tokens, parents, scores = best_nodes(draft.tokens, draft.parents, draft.scores, n)
    return SuffixDraft(tokens, parents, scores, draft.match_len, draft.occurrences)
