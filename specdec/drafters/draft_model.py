"""Independent draft model (Leviathan et al. 2023; Chen et al. 2023).

A smaller model with the same tokenizer runs autoregressively for k steps with its own
KV cache, kept in step with the target: after verification the cache is rolled back to
the accepted prefix, and the next `propose` feeds whatever committed tokens the draft has
not seen yet (the recovered/bonus token, or more after a rollback; of a prompt or many steps
sat out, a window of the last ones: CATCH_UP_WINDOW).

With sampling, draft tokens are drawn from the draft's warped distribution q and q is
returned for exact rejection sampling; greedy drafts are argmax guesses.
"""

from __future__ import annotations

import itertools
import time

import torch

from ..models.llama import ATTEND_MAX_T, packed_linear, step_call
from ..sampling import draw
from ..types import SpecdecError
from .base import Draft, DraftContext, Drafter, RowInfo, fastest, steady
from ..models.kernel_glue import draft_on_rowstable, pack_drafting_head


class DraftModelDrafter(Drafter):
    name = "draft"
    samples_guesses = True  # sampled decoding draws guesses from the draft's q

    def __init__(self, model, vocab_size: int | None = None, vocab_subset: list[int] | None = None,
                 confidence: float = 0.0, target_model=None, lazy: bool = False) -> None:
        """vocab_subset: token ids the draft may propose (a frequency-ranked head: reading
        8k rows instead of 49k is most of a small draft's cost). Exact: q is 0 elsewhere.
        confidence: a row stops drafting after a guess the draft gives less than this
        probability (0: always the full length). Exact either way: when to stop depends only
        on the draft's own numbers, never on the target's.
        target_model: given, the draft runs its decoding steps on the target's row-stable kernels
        where the target does (draft_on_rowstable) and is packed for oneDNN (pass an unpacked
        model then). lazy: a joining row's prompt is read when the draft first drafts for it (a
        catch-up the cost model prices), not at once: beside prompt lookup, a request whose lookups
        do better never pays the draft's prefill."""
        self.model = model
        self.lazy = lazy
        self.vocab_size = vocab_size or model.vocab_size  # the target's vocabulary (q is padded to it)
        self.subset = None
        self.head_packed = self.head_dtype = None  # a prepacked subset head (kernel_glue.pack_drafting_head)
        self.head_rs = None  # or (op, *args) on the row-stable kernels (draft_on_rowstable)
        native = getattr(model, "native", False)
        if vocab_subset is not None and native:
            self.subset = torch.tensor(sorted(set(int(i) for i in vocab_subset)), dtype=torch.long)
            if int(self.subset.max()) >= self.vocab_size:
                raise SpecdecError("the draft's vocabulary subset names ids beyond the target's vocabulary")
            self.head = model.lm_head_rows(self.subset).detach().contiguous()  # [S, D]
        if target_model is not None and native:
            self.head_rs = draft_on_rowstable(model, self.head if self.subset is not None else None, target_model)
        if self.subset is not None and self.head_rs is None:
            self.head_packed, self.head_dtype = pack_drafting_head(self.head)
        if target_model is not None and native:
            model.pack()  # oneDNN for every call not on the row-stable kernels
        self.confidence = confidence
        self.cache = None
        self.fed: list[list[int]] = []  # per row: the tokens the draft has accounted for, in order
        self.skipped: list[int] = []  # per row: those of `fed` a windowed catch-up left out of the cache
        self.ctx_len: list[int] = []  # per row: committed tokens fed before the last proposal
        self._timing: tuple[float, bool] | None = None  # (seconds, steady) of the last proposal
        self._behind = 0  # the most tokens a row caught up on at the last proposal

    def begin(self, prompts, params, max_len: int) -> None:
        B = len(prompts)
        if max_len > self.model.max_context:
            raise SpecdecError(f"the draft model's context ({self.model.max_context}) is shorter than this request needs ({max_len})")
        self.cache = self.model.new_cache(B, max_len)
        self.fed = [[] for _ in range(B)]
        self.skipped = [0] * B
        self.ctx_len = [0] * B

    #: a row further behind than this (a prompt the draft first drafts for, many steps sat out)
    #: reads only its last this many tokens, after its first SINK_TOKENS where its cache is empty
    #: (StreamingLLM's attention sinks): positions run on in the cache, so rotary attention sees
    #: the same distances within what was read. Sinks and window fill one forward of ATTEND_MAX_T
    #: tokens, which takes the row-stable kernels (a longer one the prefill path, ~2.5x the time
    #: a token). With the shipped draft at a fixed k 4 (17 dev prompts of 40-769 tokens, 96
    #: tokens; a plain step ~6.5 ms): a request's first catch-up (what a fresh engine's probe
    #: pays) 14.3 -> 4.3 ms, tokens a target forward 1.449 -> 1.436 greedy, 1.393 -> 1.384 at
    #: t 0.8; a window of 28 3.5 ms and 1.426 greedy
    SINK_TOKENS = 4
    CATCH_UP_WINDOW: int | None = ATTEND_MAX_T - SINK_TOKENS

    def _window(self, b: int, new: list[int]) -> list[int]:
        """What row b's catch-up on `new` reads: all of it, or CATCH_UP_WINDOW's cut."""
        window = self.CATCH_UP_WINDOW
        sink = 0 if self.fed[b] else self.SINK_TOKENS
        if window is None or len(new) <= sink + window:
            return new
        return new[:sink] + new[-window:]

    def _feed(self, new: list[list[int]], read: list[list[int]] | None = None):
        """Account for per-row token lists (ragged), forwarding `read` (default `new`: each
        row's tokens or a windowed cut of them); return the scores at each row's last token:
        [B, V] logits, or [B, S] over the vocabulary subset when there is one."""
        read = new if read is None else read
        for b, (n, r) in enumerate(zip(new, read)):
            self.fed[b].extend(n)
            self.skipped[b] += len(n) - len(r)
        return self._forward(read)

    def _forward(self, new: list[list[int]]):
        """Forward per-row token lists into the draft's cache at the positions after each row's
        cached tokens; the scores at each row's last one (`_feed`)."""
        B = len(new)
        T = max(len(n) for n in new)
        lens = self.cache.lengths.clone()
        if T == 1 and all(new):  # the drafting loop's steady state: one token per row
            toks = torch.tensor(new, dtype=torch.long)  # [B, 1]
            pos = lens[:, None]
            last = torch.zeros(B, dtype=torch.long)
        else:
            toks = torch.zeros(B, T, dtype=torch.long)
            for b, n in enumerate(new):
                toks[b, : len(n)] = torch.tensor(n, dtype=torch.long) if n else 0
            pos = lens[:, None] + torch.arange(T)[None, :]
            last = torch.tensor([max(len(n) - 1, 0) for n in new])
        if self.subset is None:
            logits, _ = self.model(toks, pos, self.cache, logits_at=last[:, None])
            logits = logits[:, 0]
        else:
            _, hidden = self.model(toks, pos, self.cache, logits_at=torch.empty(B, 0, dtype=torch.long))
            logits = self._head(hidden[:, 0] if T == 1 else hidden[torch.arange(B), last])  # [B, S]
        self.cache.truncate(lens + torch.tensor([len(n) for n in new]))
        return logits

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """Scores [N, S] over the vocabulary subset for hidden states h [N, D]."""
        if self.head_rs is not None and step_call(h):
            return self.head_rs[0](h, *self.head_rs[1:])
        if self.head_packed is not None:
            return packed_linear(h.to(self.head_dtype), self.head_packed).float()
        return (h @ self.head.T).float()

    def lags(self, tokens: list[list[int]]) -> list[int]:
        """Per row of `tokens`, the committed tokens the draft's next proposal first catches up
        on (at most a window's worth, `CATCH_UP_WINDOW`)."""
        return [len(self._window(b, t[len(f):])) for b, (t, f) in enumerate(zip(tokens, self.fed))]

    def behind(self, tokens: list[list[int]]) -> int:
        """The most tokens a row of `tokens` has for the draft's next proposal to catch up on (`lags`)."""
        return max(self.lags(tokens), default=0)

    def draft_timing(self) -> tuple[float, bool] | None:
        """(seconds, steady) of the last proposal: steady unless it first caught up on more than
        a step's worth of tokens (a prompt that just joined, steps the draft sat out)."""
        return self._timing

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        t0 = time.perf_counter()
        draft = self._propose(ctx, max_tokens)
        self._timing = (time.perf_counter() - t0, steady(self._behind, max_tokens))
        return draft

    def _propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        B = len(ctx.tokens)
        self._behind = 0
        if max_tokens <= 0:
            return Draft.empty(B)
        # feed what the draft has not seen; every row has at least its pending token
        new = [t[len(f):] for t, f in zip(ctx.tokens, self.fed)]
        if any(len(n) == 0 for n in new):
            raise RuntimeError("draft cache is ahead of the committed context (commit() was not called)")
        read = [self._window(b, n) for b, n in enumerate(new)]
        self._behind = max(len(r) for r in read)  # (`behind`)
        logits = self._feed(new, read)
        self.ctx_len = [len(f) for f in self.fed]
        toks, probs = [], []
        counts = torch.full((B,), max_tokens, dtype=torch.long)
        live = torch.ones(B, dtype=torch.bool)
        for i in range(max_tokens):
            scores = logits[:, : self.vocab_size].float()
            nxt, q = draw(scores, ctx.params, ctx.generator, self.subset, self.vocab_size)
            if q is not None:
                probs.append(q)
            toks.append(nxt)
            if self.confidence > 0 and i + 1 < max_tokens:
                # the draft's own probability of the token it just guessed (its unwarped
                # distribution): a row stops guessing after a token the draft doubts
                idx = nxt if self.subset is None else torch.searchsorted(self.subset, nxt)
                p = torch.softmax(scores, -1).gather(1, idx[:, None])[:, 0]
                stop = live & (p < self.confidence)
                counts[stop] = i + 1
                live &= ~stop
                if not bool(live.any()):
                    break
            if i + 1 < max_tokens:
                logits = self._feed([[int(x)] for x in nxt])
        tokens = torch.stack(toks, 1)  # [B, K]
        return Draft(tokens, counts, torch.stack(probs, 1) if probs else None)

    def commit(self, num_accepted, paths=None) -> None:
        # the cache holds context + d1..d_{K-1}; keep context + the accepted drafts.
        # e.g. context [a b c], drafts [d e f] fed as far as [d e], 1 accepted -> keep [a b c d]
        for b, n in enumerate(num_accepted):
            self.fed[b] = self.fed[b][: self.ctx_len[b] + int(n)]
        self.cache.truncate(torch.tensor([len(f) - s for f, s in zip(self.fed, self.skipped)]))

    def skip(self) -> None:
        pass  # a step without drafting: the next proposal feeds what the draft has not seen

    def time_alone(self) -> tuple[float, float]:
        """(seconds per drafted guess, per token of a forward that reads 32 at once: what a
        catch-up costs a token), each the fastest of a few forwards on a scratch cache of its
        own: the cost model prices the draft model before its first proposal for a few forwards
        instead of a catch-up on a whole prompt. The rows' state is left as it was."""
        return self._time_forward(), self._time_forward(read=32)

    def _time_forward(self, steps: int = 2, read: int = 1) -> float:
        """Seconds per token of a forward reading `read` tokens at once: the fastest of `steps`
        after a warm-up forward (`base.fastest`)."""
        saved = self.cache, self.fed, self.skipped
        vocab = self.model.vocab_size
        calls = itertools.count()

        def forward() -> None:
            i = next(calls)
            self._feed([[(i * read + j + 1) % vocab for j in range(read)]])

        try:
            self.cache, self.fed, self.skipped = self.model.new_cache(1, (steps + 1) * read + 1), [[]], [0]
            return fastest(forward, steps) / read
        finally:
            self.cache, self.fed, self.skipped = saved

    def join(self, row: RowInfo) -> None:
        self.add_row(row.max_len, None if self.lazy else row.prompt)

    def add_row(self, max_len: int, prompt: list[int] | None = None) -> None:
        """Append a row (a request joining a running batch; `begin` must have run with the same
        max_len, an empty batch is fine), its `prompt` written to the draft's cache in a
        forward of its own so the other rows' next proposal is not padded to it."""
        one = self.model.new_cache(1, max_len)  # (append_rows refuses a cache of another size)
        fed = list(prompt or [])
        if fed:
            self.model(torch.tensor([fed]), torch.arange(len(fed))[None], one,
                       logits_at=torch.empty(1, 0, dtype=torch.long))
        self.cache.append_rows(one)
        self.fed.append(fed)
        self.skipped.append(0)
        self.ctx_len.append(len(fed))

    def keep_rows(self, rows) -> None:
        idx = torch.as_tensor(rows, dtype=torch.long)
        self.cache.reorder_rows(idx)
        self.fed = [self.fed[r] for r in rows]
        self.skipped = [self.skipped[r] for r in rows]
        self.ctx_len = [self.ctx_len[r] for r in rows]


def check_same_vocabulary(target_tok, draft_tok) -> None:
    """Refuse a draft whose tokenizer maps text to different ids than the target's."""
    if target_tok is None or draft_tok is None:
        return
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if tv != dv:
        only_t = len(set(tv.items()) - set(dv.items()))
        raise SpecdecError(
            f"the draft's tokenizer differs from the target's ({len(dv)} vs {len(tv)} tokens, "
            f"{only_t} target entries missing or renumbered in the draft); a draft model must share "
            "the target's vocabulary"
        )


#: a row stops drafting after a guess the draft itself gives less probability than this. Measured
#: with the shipped draft (6 HumanEval + 8 Spec-Bench dev prompts, 96 tokens, k 4, README):
#: 0 -> 1.08x / 1.01x of plain, 0.3 -> 1.16x / 1.10x, 0.4 -> 1.16x / 1.10x, 0.7 -> 1.13x / 1.11x
DEFAULT_CONFIDENCE = 0.4
