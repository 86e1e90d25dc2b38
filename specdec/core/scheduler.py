"""The scheduler: continuous batching with speculation, behind `specdec serve` and
`Engine.generate` alike.

Rows join and leave between steps; `serve` submits requests as they arrive, `generate` submits
every prompt of its batch at the start (with `shared` settings, `fill_context` and
`raise_errors`, see `ContinuousBatcher`). The model runs in one thread (a worker started here, or the caller's own with `run()`:
`specdec serve` keeps it in the main thread, see `run`). Between steps, waiting requests
join the running batch (each is prefilled on its own, then its KV rows are copied into the
shared cache) and finished or cancelled ones leave it at once (the last active row moves
into the freed slot, so active rows are always 0..A-1). Each step looks up every row's
context (prompt lookup, the adaptive `NgramDrafter`); with method `auto` an EAGLE head
(`LookupEagleDrafter`) may draft a dynamic token tree for rows where that is worth more
than their lookup. All rows' pending tokens and guesses are scored in one target forward
(chains and trees side by side, a tree through its ancestor mask), each row is verified
with its own sampling settings (chain rule or the exact tree rule), the cache keeps each
row's accepted path, and the committed tokens are streamed.

Load-aware speculation: verifying guesses is nearly free while decoding is bound by
reading the weights, but as the batch grows the step becomes compute-bound and every
guessed token costs real time. Each step asks `core.policy.LoadPolicy` for the cap K in
0..k_max (and which rows draft a tree or take a draft model's guesses) that maximises the
batch's expected committed tokens per second, from a step-time fit t(A, K) = a + r * A +
b * A * K per batch-size band (`StepModel`), the lookup's learnt per-position acceptance
(`Drafter.expected_tokens`), the tree's measured gain and the drafters' steady timings
(`Drafter.draft_timing`); it probes a guess more every 16th step, and a tree in small
batches, so the costs stay measured. Behind it, in batches of 2+ rows, `core.policy.BatchGuard`
compares the measured tokens per second of speculative and plain steps and turns a step
plain while speculation measures slower (a backstop for loads the model misjudges). The
decision is exposed in `stats()` (and so in /metrics).

Method `draft` guesses with an independent draft model (`DraftModelDrafter`, a native model
with the target's tokenizer) instead of prompt lookup: its argmax guesses, one-hot q, so
sampled rows verify them exactly with the chain rule; a row stops guessing after a token the
draft doubts. Each request's prompt goes into the draft's cache when it joins. The cap K is
chosen as above, from the draft's measured acceptance per position (the share of row-steps
allowed a j-th guess in which the j-th guess held) and its measured drafting time per token
(a line in the number of rows; a draft model nothing has timed is timed alone when the
scheduler starts); K = 0 skips the draft model for the step (it catches up on the next, and
the catch-up is priced: `LoadPolicy.choose_draft`). The server asks for deterministic guesses
only, so a seeded sampled row commits the text plain sampling draws with its seed whatever was
guessed for it (verify.py, "sample and compare"): seeded rows speculate like any other, and
their text does not depend on the load. `generate`'s unseeded sampled rows (`shared`) take
guesses drawn from the draft model's q instead, which hold more often.
Method `auto` with a draft model (instead of an EAGLE head; pass the `HybridDrafter` pair or the
bare draft model) keeps prompt lookup beside it: per step and row, the lookup or the draft
model's guesses, whichever promises more tokens per second under the cap; the draft model reads
a row's prompt only when it first drafts for it.

Any other drafter (Medusa, an EAGLE head alone, one written against `drafters.Drafter`) runs
through the protocol alone (`_propose_generic`), priced by the same cost model: a chain's length
as a draft model's (its acceptance per position, its drafting time per guess), a tree drafted
or not by its acceptance per depth against its nodes' cost; then the batch guard, and each row
capped by its own cap and room. `Engine.generate` runs every method this way, with the engine's
LoadPolicy (`policy`), which it keeps between calls. Every method scores, verifies and commits
through one step (`core.step.run_step`).

This module knows nothing about HTTP or text: it takes token ids and sampling settings and
calls back with token ids (and, when a request asks for them, each token's log-probability
under the target's raw distribution, before temperature and top-p, with the N most likely
alternatives: the rows of the verification forward that produced the tokens, the same
distribution plain decoding computes). Stop strings are the caller's `stop_fn`.

One request never breaks another: a request whose own work fails (its prefill, its
verification, its callbacks or stop check) ends alone with finish reason "error", logged once
on the "specdec.batcher" logger with its id; only a failure of the shared forward ends the
rows of that step (logged with their ids). The counters balance: requests = finished +
cancelled + failed + running + queued. `warm_up` pays the first steps' one-off costs before a
server reports ready; `drain` stops admitting and ends what is still open after a grace time
(reason "shutdown")."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import threads
from .policy import BatchGuard, LoadPolicy
from .step import run_step
from ..drafters.base import Draft, DraftContext, Drafter, timing_free
from ..drafters.draft_model import DraftModelDrafter
from ..drafters.hybrid import HybridDrafter
from ..drafters.ngram import NgramDrafter
from ..sampling import choose, make_generator
from ..types import MAX_GUESSES, RequestStats, SamplingParams, SpecdecError

errors = logging.getLogger("specdec.batcher")  # each failure once, with the request ids it ended

# finish reasons of a request that did not end normally: its own row failed; the server shut down
FAILED = ("error", "shutdown")


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    on_tokens: Callable[[list[int]], None]  # newly committed ids (called from the worker thread)
    on_done: Callable[[str, dict], None]  # (finish reason, stats) when the request ends
    stop_fn: Callable[[list[int]], bool] | None = None
    spec_k: int | None = None  # per-request cap on guesses (None: the server's policy; 0: off)
    trees: bool = True  # with method auto: may this request draft EAGLE trees or take a draft model's guesses
    # (False: prompt lookup only)
    logprobs: int | None = None  # None: off; N >= 0: each token's log-probability and the N most likely
    prompt_logprobs: int | None = None  # as logprobs, for the prompt's tokens (set in prompt_lps at the prefill)
    score_only: bool = False  # prefill (and prompt_logprobs) only: no token is generated
    id: str = ""  # the caller's request id, for the log
    prediction: list[int] | None = None  # the predicted answer, tokenised (OpenAI's `prediction`): a draft source
    constraint: object | None = None  # the answer's grammar state (specdec.grammar.Constraint), if any
    key: int = 0  # its key for the uniforms its sampled tokens take (sampling.position_uniforms)
    cancelled: bool = False
    prompt_lps: list | None = None  # [None, (lp, alts), ...] per prompt token, when prompt_logprobs was asked
    tokens: list[int] = field(default_factory=list)
    context: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    submitted: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    decode_start: float | None = None  # when its decoding began (after the prefills it joined with)
    stats: RequestStats = field(default_factory=RequestStats)  # counts and times, as generate reports them
    feats: list = field(default_factory=list)  # target features not yet handed to an EAGLE head

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class _Step:
    """One decode step's plan, from the proposal to the verification."""
    A: int
    room: list[int]  # tokens each row may still take beyond its pending one
    k: int = 0  # the step's cap on guesses (0: a plain step)
    caps: list[int] = field(default_factory=list)  # each row's own cap
    guesses: list[list[int]] = field(default_factory=list)
    use_tree: list[bool] = field(default_factory=list)
    use_draft: list[bool] = field(default_factory=list)
    drafted_k: int = 0  # the draft model's guesses per row (0: not run this step)
    probs: torch.Tensor | None = None  # [A, K, V] q of guesses a drafter sampled (generate's settings)
    q: torch.Tensor | None = None  # [A, drafted_k, V] the draft model's q, when it sampled its guesses
    lags: list[int] = field(default_factory=list)  # per row, tokens the draft model has not read
    t_head: float = 0.0  # seconds the EAGLE head or the draft model drafted
    steady: bool = True  # and whether it drafted in steady state (Drafter.draft_timing)
    proposed: bool = False  # a generic drafter proposed this step (and is told what was kept)
    counts: torch.Tensor | None = None  # [A] guesses per row
    drafted: torch.Tensor | None = None  # [A, K]
    parents: torch.Tensor | None = None  # [A, K] tree parents (None: chains)
    K: int = 0
    is_tree: bool = False


class ContinuousBatcher:
    def __init__(self, model, eos_ids=(), method: str = "ngram", k_max: int = 8, max_batch: int = 16,
                 max_queue: int = 256, max_context: int | None = None, adaptive: bool = True, drafter=None,
                 thread: bool = True, shared: SamplingParams | None = None, fill_context: bool = False,
                 raise_errors: bool = False, policy: LoadPolicy | None = None) -> None:
        """method: none, ngram (prompt lookup), auto (prompt lookup + an EAGLE tree or a draft
        model; pass the `LookupEagleDrafter`, the `HybridDrafter` or the bare `DraftModelDrafter`
        as `drafter`), draft (a draft model; pass its `DraftModelDrafter`), or any other name with
        a `Drafter` (Medusa, EAGLE, your own) run through the protocol alone (`_propose_generic`).
        thread: run the model in a worker thread started here; False: the caller runs `run()`
        (best in the main thread, see `run`).
        shared: the sampling settings of every request, when all share one object and one
        generator (`Engine.generate`): rows verify in one call, each keyed by `Request.key`, and
        the drafter drafts with these settings (a draft model samples its guesses from its q);
        None (the server): each request its own, and drafters guess greedily (one-hot q).
        fill_context: a request longer than the context allows is not refused; it decodes until
        the context is full (finish reason "length"). raise_errors: a failure is raised to the
        caller of `run()` instead of ending the requests it touched (generate). adaptive: the
        cost model prices every step (False: every step drafts k_max, as `--fixed-k`; so does a
        drafter that may not sit a step out, `Drafter.may_skip` False). policy: the `LoadPolicy`
        that prices the steps, when its owner keeps what it learns beyond this scheduler
        (`Engine`); None: a new one."""
        # any other method: the given drafter alone, through the drafter protocol (Medusa, EAGLE, ...)
        generic = method not in ("none", "ngram", "auto", "draft")
        if generic and not isinstance(drafter, Drafter):
            raise SpecdecError(f"the server drafts with 'none', 'ngram', 'auto', 'draft' or a drafter of method "
                               f"{method!r} (a specdec.drafters.Drafter); none was given")
        # auto with a draft model comes as the pair (`HybridDrafter`: its lookup and its draft model)
        pair = isinstance(drafter, HybridDrafter)
        draft_model = drafter.draft if pair else drafter
        model_drafter = isinstance(draft_model, DraftModelDrafter) and getattr(draft_model.model, "native", False)
        if method == "auto" and not (hasattr(drafter, "assemble") or model_drafter):
            raise SpecdecError("method 'auto' needs a prompt-lookup + EAGLE drafter (an EAGLE head for this model) "
                               "or a draft model the native loader runs (Llama family) with the target's tokenizer")
        if method == "draft" and (pair or not model_drafter):
            raise SpecdecError("method 'draft' needs a draft model the native loader runs (Llama family) with the "
                               "target's tokenizer")
        if not 0 <= k_max <= MAX_GUESSES:
            raise SpecdecError(f"k_max must be between 0 and {MAX_GUESSES} (longer steps are not verified bit for bit "
                               f"as plain decoding computes them), got {k_max}")
        self.model = model
        self.eos = set(int(e) for e in eos_ids)
        self.method = method
        self.shared, self.fill_context, self.raise_errors = shared, fill_context, raise_errors
        self.k_max = k_max if method != "none" else 0
        self.adaptive = adaptive = adaptive and (not generic or drafter.may_skip)
        self.max_batch = max_batch
        self.max_context = min(max_context or model.max_context, model.max_context)
        self.waiting: queue.Queue[Request] = queue.Queue(maxsize=max_queue)
        self.rows: list[Request] = []
        self.cache = model.new_cache(max_batch, self.max_context)
        self.generic = generic
        # guess slots a row may take in one step: k_max, or a generic tree drafter's node budget
        self.slots = max(self.k_max, drafter.max_nodes) if generic else self.k_max
        # load-aware: whole lookups, capped per step by the LoadPolicy; fixed: the drafter's own length choice
        # auto with a draft model: prompt lookup where it is worth more, the draft model elsewhere
        self.mixed = mixed = method == "auto" and model_drafter
        self.trees = method == "auto" and not mixed
        self.drafting = method == "draft" or mixed  # a draft model guesses (instead of, or beside, prompt lookup)
        self._take_drafter(drafter, draft_model, pair)
        # the cost model and the per-step choice
        self.policy = policy if policy is not None else LoadPolicy(self.k_max, adaptive)
        if self.drafting and adaptive and self.k_max > 0 and self.policy.draft_time.weight < 1e-9:
            # price the draft model before its first proposal (a few forwards of its own: drafting
            # a guess, reading 32 tokens at once) instead of catching it up on a whole prompt to time it
            self.policy.observe_draft_time(1, self.drafter.time_alone())
            self.policy.t_catch = self.drafter.time_alone(read=32)
        if self.lookup is not None and self.lookup.policy is not None:
            # one step-time fit: the lookup (and auto's tree gate and trim, which read the lookup's
            # plain step and r) price guesses on the steps this scheduler times
            self.lookup.policy.share_times(self.policy.steps)
        # a measured backstop to the cost model in batches of 2+ rows: speculative steps must
        # commit more tokens per second than plain ones (see core.policy.BatchGuard)
        self.guard = BatchGuard() if adaptive and self.k_max > 0 else None
        self.feeds_hidden = self.trees or (generic and drafter.needs_hidden)  # rows keep features for the drafter
        self.last_k = 0
        self.lock = threading.Lock()
        self.totals = dict(requests=0, finished=0, cancelled=0, failed=0, tokens=0, first_tokens=0, proposed=0,
                           accepted=0, forwards=0, steps=0, tree_rows=0, draft_rows=0, lookup_rows=0)
        self.log = None  # a logging.Logger: one debug line per step (batch size, chosen draft length)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._drain_until: float | None = None  # set by drain(): finish what runs, admit nothing new
        self.ready = threading.Event()  # set once warm (see warm_up), or at once when no warm-up is asked
        self.thread = None
        if thread:
            self.ready.set()
            self.thread = threading.Thread(target=self._loop, name="specdec-batcher", daemon=True)
            self.thread.start()

    def _take_drafter(self, drafter, draft_model, pair: bool) -> None:
        """`drafter` and `lookup` for this scheduler's method, each begun with no rows (they join
        with add_row): a generic drafter alone; auto's tree drafter and its lookup; a draft model
        and, for auto, the pair's lookup (generate's, with what it learnt) or a new one; for
        ngram the given prompt-lookup drafter or a new one. Fixed (not adaptive): the lookup
        chooses its own lengths."""
        if self.generic:
            self.drafter, self.lookup = drafter, None
            drafter.begin([], self.shared, self.max_context)
            return
        if self.trees:
            self.drafter, self.lookup = drafter, drafter.ngram
            drafter.begin([], None, self.max_context)
        elif self.drafting:
            self.drafter = draft_model
            self.lookup = (drafter.ngram if pair else NgramDrafter()) if self.mixed else None
            self.drafter.begin([], None, self.max_context)
        elif self.method == "ngram":
            self.drafter = self.lookup = drafter if isinstance(drafter, NgramDrafter) else NgramDrafter()
        else:
            self.drafter = self.lookup = None
        if self.lookup is not None:
            self.lookup.choose_length = not self.adaptive

    # -- public -----------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        """Queue a request; raises queue.Full when the queue is full (the caller answers 429), and
        SpecdecError when it cannot fit the context or the batcher is draining."""
        if self.draining:
            raise SpecdecError("the server is shutting down and takes no new requests")
        if not self.fill_context and len(req.prompt) + req.params.max_new_tokens + self.slots + 2 > self.max_context:
            raise SpecdecError(f"prompt ({len(req.prompt)} tokens) plus max_tokens ({req.params.max_new_tokens}) "
                               f"exceeds the context of {self.max_context} tokens")
        if req.generator is None:  # (generate's requests share one)
            req.generator = make_generator(req.params.seed)
        if self.waiting.full():  # requests cancelled while queued (timed out, client gone) hold no place
            with self.waiting.mutex:
                live = [r for r in self.waiting.queue if not r.cancelled]
                dropped = len(self.waiting.queue) - len(live)
                self.waiting.queue.clear()
                self.waiting.queue.extend(live)
            with self.lock:
                self.totals["cancelled"] += dropped
        self.waiting.put_nowait(req)
        with self.lock:
            self.totals["requests"] += 1
        self._wake.set()

    def stats(self) -> dict:
        with self.lock:
            t = dict(self.totals)
        t.update(batch=len(self.rows), queued=self.waiting.qsize(), draft_k=self.last_k,
                 alpha=t["accepted"] / t["proposed"] if t["proposed"] else 0.0,
                 tau=(t["tokens"] - t["first_tokens"]) / t["forwards"] if t["forwards"] else 0.0)
        return t

    def run(self, until: Callable[[], bool] | None = None, warm: bool = False) -> None:
        """Decode until `close()` (from another thread), until `until()` is true (checked
        between steps) or until a `drain()` has ended. warm: first run `warm_up()` (`ready`
        is set after it). `specdec serve` runs this in the main
        thread, with the HTTP server in a thread: with torch's OpenMP threads, every parallel
        kernel launched from a second thread on a machine with few cores pays a wake-up of
        its own thread team (libgomp stops spinning once there are more OpenMP threads than
        cores; our reading): measured on 2 cores, a decode step of the default model takes
        23.8 ms from a second thread and 15.4 ms from the main thread
        (benchmarks/thread_step.py)."""
        if warm and not self.ready.is_set():
            self.warm_up()
        self.ready.set()
        self._loop(until)

    def warm_up(self, steps: int = 12) -> float:
        """Decode one made-up request on this thread (the model's): the first prefill and the
        first speculative steps pay one-off costs (kernel dispatch, the drafters' buffers,
        allocator growth) that would otherwise land on the first client, ~6 s against
        ~0.35 s later on the default model. The prompt repeats itself, so prompt lookup and
        the drafters guess and the verification paths run. Counters are restored after; the
        cost model keeps what it measured. Returns the seconds it took."""
        t0 = time.perf_counter()
        saved = dict(self.totals)
        self.policy.eager = True  # the head runs in the warm-up, timed or not
        prompt = [(7 * i) % 97 + 10 for i in range(24)] * 3
        done = threading.Event()
        room = self.max_context - len(prompt) - self.k_max - 3
        if room >= 1:
            req = Request(prompt, SamplingParams(max_new_tokens=min(steps, room)), lambda *_: None,
                          lambda *_: done.set(), id="warm-up")
            req.generator = make_generator(0)
            self._prefill(req)
            while self.rows and not done.is_set():
                self._step()
        self.policy.eager = False
        with self.lock:
            self.totals = saved
        return time.perf_counter() - t0

    def drain(self, seconds: float) -> None:
        """Stop admitting new requests; requests already submitted may run for `seconds` more,
        then each still open ends with reason "shutdown" and the loop returns. Callable from any
        thread (a signal handler included)."""
        self._drain_until = time.perf_counter() + max(0.0, seconds)
        self._wake.set()

    @property
    def draining(self) -> bool:
        return self._drain_until is not None

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=10)

    def end_all(self, reason: str = "shutdown") -> None:
        """End every running and queued request with `reason` (on the model thread, or once it
        has stopped)."""
        while self.rows:
            self._remove(len(self.rows) - 1, reason)
        while True:
            try:
                req = self.waiting.get_nowait()
            except queue.Empty:
                break
            self._finish(req, "cancelled" if req.cancelled else reason)

    # -- worker -----------------------------------------------------------------------
    def _loop(self, until: Callable[[], bool] | None = None) -> None:
        while not self._stop.is_set() and not (until is not None and until()):
            if self._drain_until is not None and (time.perf_counter() >= self._drain_until or
                                                  (not self.rows and self.waiting.empty())):
                self.end_all("shutdown")
                return
            try:
                self._admit()
                if not self.rows:
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                self._step()
            except Exception as e:  # noqa: BLE001 - a failure no single row caused: end the rows in it
                if self.raise_errors:
                    raise
                self._fail_step(e)

    def _fail_step(self, e: Exception) -> None:
        """A step failed outside any one row's work (the shared forward, say): its rows end with
        an error (logged once, with their ids), the cache and drafters start empty, and the
        server keeps serving."""
        ids = [r.id for r in self.rows]
        errors.error("decode step failed; ending its requests %s: %s: %s", ids, type(e).__name__, e, exc_info=e)
        for r in self.rows:
            self._finish(r, "error")
        self.rows = []
        self.cache.lengths.zero_()
        if self.trees or self.drafting or self.generic:
            try:
                self.drafter.keep_rows([])
            except Exception:  # noqa: BLE001 - already failing: the log has the first error
                errors.exception("resetting the drafter after a failed step failed too")

    def _admit(self) -> None:
        """Waiting requests join while there is room, each prefilled on its own; those that joined
        together share the prefill time (they waited for each other) and start decoding after it."""
        t0, joined = time.perf_counter(), []
        while len(self.rows) < self.max_batch:
            try:
                req = self.waiting.get_nowait()
            except queue.Empty:
                break
            if req.cancelled:
                self._finish(req, "cancelled")
                continue
            try:
                self._prefill(req)
            except Exception as e:  # noqa: BLE001 - this request's own failure: it ends alone
                self._fail_row(req, e, "prefill")
            joined.append(req)
        now = time.perf_counter()
        for req in joined:
            req.stats.prefill_s, req.decode_start = now - t0, now

    def _fail_row(self, req: Request, e: Exception, where: str) -> None:
        """One request failed in its own work (prefill, sampling, verification, its stop
        check): it ends alone with reason "error", logged once with its id."""
        if self.raise_errors:
            raise e
        errors.error("request %s failed in its %s: %s: %s", req.id or "(no id)", where, type(e).__name__, e,
                     exc_info=e)
        if req in self.rows:
            self._remove(self.rows.index(req), "error")
        else:
            self._finish(req, "error")

    @torch.inference_mode()
    def _prefill(self, req: Request) -> None:
        t0 = time.perf_counter()
        L = len(req.prompt)
        req.stats.prompt_tokens = L
        # a one-row batch prefills into its cache (the transformers adapter has no other)
        one = self.cache if self.max_batch == 1 else self.model.new_cache(1, L + 1)
        at = torch.arange(L)[None] if req.prompt_logprobs is not None else torch.tensor([[L - 1]])
        logits, hidden = self.model(torch.tensor([req.prompt]), torch.arange(L)[None], one, logits_at=at)
        if req.prompt_logprobs is not None:
            req.prompt_lps = [None] + _logprobs(logits[0, :-1], req.prompt[1:], req.prompt_logprobs)
        if req.score_only:
            self._finish(req, "length")
            return
        first = int(choose(logits[:, -1], req.params, req.generator, rows=[req.key], positions=[L])[0])
        slot = len(self.rows)
        if self.trees or self.drafting or self.generic:
            # beside prompt lookup, the draft model reads the prompt when it first drafts for the
            # row (a catch-up): a request whose lookups do better never pays the draft's prefill
            self.drafter.add_row(self.max_context, None if self.mixed else list(req.prompt))
        if self.feeds_hidden:
            req.feats = [hidden[0, :L]]
        if one is not self.cache:
            self.cache.fill_row(slot, one)
        req.context = list(req.prompt) + [first]
        req.first_token_s = time.perf_counter() - req.submitted
        self.rows.append(req)
        if self.log is not None:
            self.log.debug("prefill: %d tokens, row %d, %.1f ms", L, slot, (time.perf_counter() - t0) * 1e3)
        with self.lock:
            self.totals["first_tokens"] += 1
        self._emit(req, [first], _logprobs(logits[0, -1:], [first], req.logprobs))
        reason = self._done_reason(req)
        if reason and req in self.rows:
            self._remove(self.rows.index(req), reason)

    def _emit(self, req: Request, ids: list[int], lps: list | None = None) -> None:
        room = req.params.max_new_tokens - len(req.tokens)
        cut = []
        for t in ids[:room]:
            cut.append(t)
            if t in self.eos:
                break
        req.tokens.extend(cut)
        with self.lock:
            self.totals["tokens"] += len(cut)
        if cut:
            if req.logprobs is None:
                req.on_tokens(cut)
            else:
                req.on_tokens(cut, lps[: len(cut)])

    def _done_reason(self, req: Request) -> str:
        if req.cancelled:
            return "cancelled"
        if req.tokens and req.tokens[-1] in self.eos:
            return "eos"
        if len(req.tokens) >= req.params.max_new_tokens:
            return "length"
        if req.stop_fn is not None and req.stop_fn(req.tokens):
            return "stop"
        # the context is full: every slot holds a token (with fill_context; a served request was
        # refused unless its guesses fit to the end)
        if len(req.context) + (0 if self.fill_context else self.slots + 2) >= self.max_context:
            return "length"
        return ""

    def _finish(self, req: Request, reason: str) -> None:
        """Count the request's end and tell its owner (a callback that fails is logged, never
        raised into the decode loop)."""
        kind = "cancelled" if reason == "cancelled" else "failed" if reason in FAILED else "finished"
        with self.lock:
            self.totals[kind] += 1
        st = req.stats
        st.new_tokens, st.finish_reason = len(req.tokens), reason
        if req.decode_start is not None:
            st.decode_s = time.perf_counter() - req.decode_start
        try:
            req.on_done(reason, dict(prompt_tokens=len(req.prompt), completion_tokens=len(req.tokens),
                                     proposed=st.proposed, accepted=st.accepted, forwards=st.target_forwards,
                                     first_token_s=req.first_token_s))
        except Exception:  # noqa: BLE001 - the owner's problem, not the batch's
            errors.exception("request %s: its on_done callback failed", req.id or "(no id)")

    def _remove(self, i: int, reason: str) -> None:
        """Row i leaves; the last active row moves into its slot."""
        req = self.rows[i]
        last = len(self.rows) - 1
        if i != last:
            n = int(self.cache.lengths[last])
            for layer in range(len(self.cache.k)):
                self.cache.k[layer][i, :, :n] = self.cache.k[layer][last, :, :n]
                self.cache.v[layer][i, :, :n] = self.cache.v[layer][last, :, :n]
            self.cache.lengths[i] = n
            self.rows[i] = self.rows[last]
        self.cache.lengths[last] = 0
        self.rows.pop()
        if self.trees or self.drafting or self.generic:
            keep = list(range(last))
            if i != last:
                keep[i] = last
            self.drafter.keep_rows(keep)
        self._finish(req, reason)

    @torch.inference_mode()
    def _step(self) -> None:
        """One speculative step for every row: propose, score in one target forward, verify each
        row with its own settings, commit or roll back the caches, record, stream, let finished
        rows leave. A row whose own work fails (its verification, its callbacks, its stop check)
        ends alone with an error."""
        for i in reversed(range(len(self.rows))):  # drop cancelled rows first
            if self.rows[i].cancelled:
                self._remove(i, "cancelled")
        if not self.rows:
            return
        threads.tick()  # follow the cores other processes leave free (threads.py), as generate does
        t0 = time.perf_counter()
        s = self._propose()
        t1 = time.perf_counter()
        cache = self.cache if s.A == self.cache.batch_size else _RowsView(self.cache, s.A)
        draft = Draft(s.drafted, s.counts, s.probs, s.parents if s.is_tree else None)
        # one shared setting and generator: one verification call for every row; else each row its own
        shared = self.shared is not None
        params = self.shared if shared else [r.params for r in self.rows]
        generators = self.rows[0].generator if shared else [r.generator for r in self.rows]
        res = run_step(self.model, cache, [r.context[-1] for r in self.rows], draft, params, generators, s.room,
                       s.use_tree, row_keys=[r.key for r in self.rows])
        if cache is not self.cache:
            cache.sync()
        n_acc = torch.tensor(res.accepted, dtype=torch.long)
        drafted_l, counts_l, failed = s.drafted.tolist(), s.counts.tolist(), res.failed
        # how deep each row's proposal reached (a tree counts as a chain as deep as the tree)
        depths = [res.proposed_depth(b, c) for b, c in enumerate(counts_l)]
        self._commit_drafters(s, res.paths, n_acc, depths)
        t2 = time.perf_counter()
        self._record(s, n_acc, t2 - t0)
        for b, r in enumerate(self.rows):
            if b in failed:
                continue
            # the rows of this step's output behind the committed tokens: the pending token's and
            # the accepted nodes' (a chain's are the first ones: a view, not a copy)
            kept, ids = res.kept(b), res.ids(b, drafted_l[b])
            if self.feeds_hidden:
                r.feats.append(res.hidden[b, kept])
            r.context.extend(ids)
            st, accepted = r.stats, len(res.paths[b])
            st.target_forwards += 1
            depth = depths[b]
            st.proposed += depth
            st.accepted += accepted
            if depth:
                st.add_position_counts(depth, accepted)
            st.draft_s += t1 - t0
            st.verify_s += t2 - t1
            try:
                self._emit(r, ids, _logprobs(res.logits[b, kept], ids, r.logprobs) if r.logprobs is not None else None)
            except Exception as e:  # noqa: BLE001 - its owner's callback failed: this row alone ends
                failed[b] = e
        self._leave(failed)

    def _propose(self) -> _Step:
        """This step's guesses: every row's lookup, the cap K and the rows that draft a tree or
        take the draft model's guesses (cost model, then the batch guard), each row's own cap,
        then the guesses packed as chains or trees."""
        A = len(self.rows)
        s = _Step(A=A, room=[min(r.params.max_new_tokens - len(r.tokens) - 1, self.max_context - len(r.context) - 2)
                             for r in self.rows])
        if self.generic:
            return self._propose_generic(s)
        guesses, gains = [[] for _ in range(A)], None
        ctx = DraftContext([r.context for r in self.rows], self.rows[0].params, None, self._hand_over_features(),
                           room=s.room)
        if self.lookup is not None:
            gains = [[1.0]] * A  # nothing looked up: one token a row
            if self.k_max > 0:
                guesses = self.lookup.lookups(ctx, self.k_max)  # (lists: no tensor a step)
                self.lookup.handed_over()
                gains = self.lookup.expected_tokens()
        tree_ok = [self.trees and r.trees and self.k_max > 0 and r.spec_k != 0 for r in self.rows]
        # rows that may take the draft model's guesses (method draft, or auto with a draft model)
        draft_ok = [self.drafting and r.trees and self.k_max > 0 and r.spec_k != 0 for r in self.rows]
        use_draft = [False] * A
        step = self.totals["steps"]  # the probing phase
        if self.drafting:
            # the tokens of each row the draft model has not read (a prompt that just joined beside
            # the lookup, steps it sat out): it reads them before drafting
            s.lags = self.drafter.lags(ctx.tokens)
            s.k, use_draft = self.policy.choose_draft(guesses, gains, step, draft_ok, s.room, s.lags)
            use_tree = [False] * A
        else:
            s.k, use_tree = self.policy.choose_k(guesses, gains, step, tree_ok, self.drafter if self.trees else None,
                                                 s.room)
        if s.k > 0 and self.guard is not None and not self.guard.speculate(A):
            s.k, use_tree, use_draft = 0, [False] * A, [False] * A
        s.caps = self._caps(s)
        s.use_draft = [u and c > 0 for u, c in zip(use_draft, s.caps)]
        s.guesses = [[] if u else g[:c] for g, c, u in zip(guesses, s.caps, s.use_draft)]
        s.drafted_k = max((c for c, u in zip(s.caps, s.use_draft) if u), default=0)
        if s.drafted_k:
            self._draft_model_guesses(s)
        s.use_tree = [u and c > 0 for u, c in zip(use_tree, s.caps)]
        self._pack(s, ctx)
        return s

    def _hand_over_features(self) -> list | None:
        """Each row's target features not yet handed to the drafter (each goes exactly once)."""
        if not self.feeds_hidden:
            return None
        out = [(r.feats[0] if len(r.feats) == 1 else torch.cat(r.feats)) if r.feats else None for r in self.rows]
        for r in self.rows:
            r.feats = []
        return out

    def _propose_generic(self, s: _Step) -> _Step:
        """A drafter alone, through the protocol: the cost model (a chain's length as a draft
        model's, `LoadPolicy.choose_draft`; a tree drafted or not, `choose_tree`), then the batch
        guard, decide how far this step speculates and for which rows, each row is capped by its
        own cap and room, and the drafter proposes (`_guess_params`); its steady drafting time
        per guess is priced."""
        ok = [self.k_max > 0 and r.spec_k != 0 for r in self.rows]
        step = self.totals["steps"]  # the probing phase
        if self.drafter.max_nodes:
            s.k, use = self.policy.choose_tree(step, ok, s.room, self.drafter.max_nodes)
        else:
            s.k, use = self.policy.choose_draft([[]] * s.A, None, step, ok, s.room)
        if s.k > 0 and self.guard is not None and not self.guard.speculate(s.A):
            s.k = 0
        s.caps = [c if u else 0 for c, u in zip(self._caps(s), use)]
        s.use_tree, s.use_draft = [False] * s.A, [False] * s.A
        if max(s.caps) == 0:
            if self.drafter.may_skip:
                self.drafter.skip()  # its features wait in the rows for the next proposal
            return self._no_guesses(s)
        t1 = time.perf_counter()
        params, generator = self._guess_params()
        ctx = DraftContext([r.context for r in self.rows], params, generator, self._hand_over_features(), room=s.room)
        d = self.drafter.propose(ctx, max(s.caps))
        s.t_head, s.proposed = time.perf_counter() - t1, True
        timing = self.drafter.draft_timing()
        if timing is not None:
            s.t_head, s.steady = timing
        if s.steady and d.tokens.shape[1] > 0:
            self.policy.observe_draft_time(s.A, s.t_head / d.tokens.shape[1])
        if d.tokens.shape[1] == 0:  # no guesses: a plain step (the proposal is still answered)
            return self._no_guesses(s)
        if d.parents is not None:  # a tree, cut to nothing for rows without a cap
            if d.tokens.shape[1] + 1 > self.max_context - int(self.cache.lengths[: s.A].max()):
                # near the end of the context a tree may not fit: the pending tokens alone (the
                # drafter is told nothing was accepted)
                self.drafter.commit([0] * s.A, paths=[[] for _ in range(s.A)])
                s.proposed = False  # (answered)
                return self._no_guesses(s)
            s.counts = torch.where(torch.tensor(s.caps) > 0, d.counts, 0)
        else:
            s.counts = torch.minimum(d.counts, torch.tensor(s.caps, dtype=torch.long))
        s.K = int(s.counts.max())
        s.drafted = d.tokens[:, : s.K]
        s.probs = d.probs[:, : s.K] if d.probs is not None and self.shared is not None else None  # (served: one-hot)
        s.parents = d.parents[:, : s.K] if d.parents is not None else None
        s.use_tree = [d.parents is not None and c > 0 for c in s.counts.tolist()]
        s.use_draft = [d.parents is None and c > 0 for c in s.counts.tolist()]  # counted as draft rows
        s.guesses = [t[:c] for t, c in zip(s.drafted.tolist(), s.counts.tolist())]
        s.is_tree = s.parents is not None and s.K > 0
        self.last_k = s.K
        return s

    def _no_guesses(self, s: _Step) -> _Step:
        """s as a plain step: each row scores its pending token alone."""
        s.counts, s.drafted, s.K = torch.zeros(s.A, dtype=torch.long), torch.zeros(s.A, 0, dtype=torch.long), 0
        self.last_k = 0
        return s

    def _caps(self, s: _Step) -> list[int]:
        """Each row's cap on guesses this step: the step's K within its own cap and room."""
        return [max(0, min(s.k, r.spec_k if r.spec_k is not None else self.k_max, room))
                for r, room in zip(self.rows, s.room)]

    def _draft_model_guesses(self, s: _Step) -> None:
        """The draft model's guesses for the rows that take them (its drafting time measured): its
        argmax, or draws from its q for `generate`'s sampled rows (`_guess_params`)."""
        params, generator = self._guess_params()
        behind = max(s.lags, default=0)
        d = self.drafter.propose(DraftContext([r.context for r in self.rows], params, generator, room=s.room),
                                 s.drafted_k)
        s.q = d.probs  # (None: argmax guesses)
        # a catch-up on tokens of rows that took their lookup for a while is a one-off, not the
        # cost of drafting: only steady proposals are timed as drafting, the others as catch-ups
        s.t_head, s.steady = self.drafter.draft_timing()
        if s.steady:
            self.policy.observe_draft_time(s.A, s.t_head / s.drafted_k)
        else:
            self.policy.observe_catch_up(s.t_head, behind, max(1, int(d.counts.max())))
        s.guesses = [d.tokens[b, : min(int(d.counts[b]), s.caps[b])].tolist() if s.use_draft[b] else g
                     for b, g in enumerate(s.guesses)]

    def _guess_params(self) -> tuple[SamplingParams, torch.Generator | None]:
        """The settings a draft model or a protocol drafter guesses with: `generate`'s shared
        ones for its sampled rows (guesses drawn from q hold more often), else greedily (one-hot
        q: the server, greedy rows). Seeded sampled rows draw from q only where nothing measured
        shapes their guesses (a fixed k, no lookup beside the drafter): a seeded row's text must
        not depend on timing, and deterministic guesses make sure it does not (verify.py,
        "sample and compare")."""
        shared = self.shared
        fixed = not self.adaptive and self.lookup is None
        if shared is not None and not shared.greedy and (fixed or not timing_free(shared)):
            return shared, self.rows[0].generator
        return _GREEDY, None

    def _pack(self, s: _Step, ctx: DraftContext) -> None:
        """The guesses as the forward takes them: [A, K] tokens, counts, and parents for trees."""
        if self.trees:
            # a tree row's lookup is grafted onto its tree, within the k_max slots a row reserves
            # the head's nodes cut to those worth verifying, as their learnt odds say (`trim`)
            draft = self.drafter.assemble(ctx, s.guesses, s.use_tree, self.k_max, max_nodes=self.k_max, trim=True,
                                          cost=self.policy.head_steps(sum(s.use_tree), s.A))
            s.t_head, s.steady = self.drafter.draft_timing()
            if s.t_head > 0:
                self.policy.observe_head(sum(s.use_tree), s.t_head, s.steady)
            # a tree cut to its first nodes stays a tree
            s.counts = torch.minimum(draft.counts, torch.tensor(s.caps, dtype=torch.long))
            s.K = int(s.counts.max())
            s.drafted = draft.tokens[:, : s.K]
            s.parents = draft.parents[:, : s.K] if draft.parents is not None else None  # (None: a plain step)
        else:
            s.counts = torch.tensor([len(g) for g in s.guesses], dtype=torch.long)
            s.K = int(s.counts.max())
            s.drafted = torch.tensor([g + [0] * (s.K - len(g)) for g in s.guesses], dtype=torch.long).reshape(s.A, s.K)
            if s.q is not None:  # the draft model's rows carry its q, lookup rows one-hot q at their guesses
                s.probs = torch.nn.functional.one_hot(s.drafted, s.q.shape[-1]).float()
                for b in range(s.A):
                    if s.use_draft[b]:
                        s.probs[b, : s.counts[b]] = s.q[b, : s.counts[b]]
        self.last_k = s.K
        s.is_tree = s.parents is not None and s.K > 0 and any(s.use_tree)  # lookup rows alone: a plain chain step

    def _commit_drafters(self, s: _Step, paths: list[list[int]], n_acc: torch.Tensor, depths: list[int]) -> None:
        """Tell the drafters what each row kept (and the cost model what held; `depths`: how deep
        each row's proposal reached)."""
        if self.generic:
            if s.proposed:  # every proposal is answered
                self.drafter.commit(n_acc.tolist(), paths=paths if s.is_tree else None)
                self.policy.observe_draft(depths, n_acc.tolist())
        elif self.trees:
            self.drafter.commit(n_acc.tolist(), paths=paths if s.is_tree else None)
        elif self.drafting:
            if s.drafted_k:  # (rows that took their lookup keep none of the draft's guesses)
                self.drafter.commit([int(n) if u else 0 for n, u in zip(n_acc, s.use_draft)])
                self.policy.observe_draft([c if u else 0 for c, u in zip(s.caps, s.use_draft)], n_acc.tolist())
            if self.lookup is not None and s.K > 0:
                self.lookup.commit(n_acc.tolist())
        elif self.drafter is not None and s.K > 0:
            self.drafter.commit(n_acc.tolist())

    def _record(self, s: _Step, n_acc: torch.Tensor, dt: float) -> None:
        """The step's time into the cost model and the guard; the counters; the debug line."""
        self.policy.observe_step(s.A, s.K, dt - s.t_head)  # drafting is priced separately
        if self.guard is not None:
            # (a step in which the drafter caught up on a prompt that just joined, or on steps it
            # sat out, is a one-off, not the steady cost of speculating: the guard does not count it)
            self.guard.observe(s.A, s.k > 0, int(n_acc.sum()) + s.A, dt, steady=s.steady)
        if self.log is not None:
            self.log.debug("step: batch %d, draft cap %d, tree rows %d, guesses %d, accepted %d, %.1f ms", s.A, s.k,
                           sum(s.use_tree), int(s.counts.sum()), int(n_acc.sum()), dt * 1e3)
        with self.lock:
            self.totals["steps"] += 1
            self.totals["forwards"] += s.A
            self.totals["proposed"] += int(s.counts.sum())
            self.totals["accepted"] += int(n_acc.sum())
            self.totals["tree_rows"] += sum(s.use_tree)
            self.totals["draft_rows"] += sum(s.use_draft)  # row-steps verifying the draft model's guesses
            self.totals["lookup_rows"] += sum(1 for g, u, t in zip(s.guesses, s.use_draft, s.use_tree)
                                              if g and not u and not t)

    def _leave(self, failed: dict[int, Exception]) -> None:
        """After a step: rows that failed in it end with an error, finished ones leave (a stop
        check that raises fails its row alone)."""
        reasons = {}
        for i, r in enumerate(self.rows):
            if i in failed:
                continue
            try:
                reasons[i] = self._done_reason(r)
            except Exception as e:  # noqa: BLE001
                failed[i] = e
        doomed = [(i, self.rows[i]) for i in sorted(set(failed) | {i for i, x in reasons.items() if x}, reverse=True)]
        for i, r in doomed:
            if i in failed:
                self._fail_row(r, failed[i], "step")
            else:
                self._remove(i, reasons[i])


_GREEDY = SamplingParams()  # the draft model's guesses are its argmax (one-hot q: exact for sampled rows too)


def _logprobs(logits: torch.Tensor, ids: list[int], top: int | None) -> list | None:
    """Per token: (its log-probability, [(id, log-probability) of the `top` most likely]) under
    the raw distribution of its logits row; None when not asked for."""
    if top is None:
        return None
    lp = torch.log_softmax(logits.float(), dim=-1)
    out = []
    for row, t in zip(lp, ids):
        alts = []
        if top > 0:
            v, i = row.topk(top)
            alts = list(zip(i.tolist(), v.tolist()))
        out.append((float(row[t]), alts))
    return out


class _RowsView:
    """The first A rows of a KVCache as a cache object for one forward (storage shared);
    `sync()` writes the row lengths back to the full cache."""

    def __init__(self, cache, rows: int) -> None:
        self.base, self.A = cache, rows
        self.k = [k[:rows] for k in cache.k]
        self.v = [v[:rows] for v in cache.v]
        self.lengths = cache.lengths[:rows].clone()
        self.max_len = cache.max_len
        self.batch_size = rows

    def __getattr__(self, name):  # reserve, write, truncate: the KVCache methods on this view
        from ..kv_cache import KVCache

        return getattr(KVCache, name).__get__(self)

    def sync(self) -> None:
        self.base.lengths[: self.A] = self.lengths
