"""The scheduler: continuous batching with speculation, behind `specdec serve` and
`Engine.generate` alike (docs/design.md, "The speculative step").

`ContinuousBatcher` holds the request lifecycle: requests are submitted (`submit`), join the
running batch between steps (each prefilled alone, its cache rows copied into the shared cache:
`_admit`), decode one step at a time (`_step`: the proposal from `proposal.Sources`, one target
forward, verification and commit in `step.run_step`), stream their tokens (`_emit`), and leave as
they finish or are cancelled (`_remove`: the last active row moves into the freed slot, so active
rows are always 0..A-1). `drain` stops admitting and ends what is still open after a grace time.

The model runs in one thread: a worker started here, or the caller's own with `run()` (`specdec
serve` keeps it in the main thread). One request never breaks another: a request whose own work
fails (its prefill, its verification, its callbacks or stop check) ends alone with finish reason
"error", logged once on the "specdec.batcher" logger with its id; only a failure of the shared
forward ends the rows of that step. The counters balance: requests = finished + cancelled +
failed + running + queued (`BatcherStats`).

This module knows nothing about HTTP or text: it takes token ids and sampling settings and calls
back with token ids (and, when asked, each token's log-probability under the target's raw
distribution with the N most likely alternatives). Stop strings are the caller's `stop_fn`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

import torch

from .. import threads
from ..drafters.base import Drafter, RowInfo
from ..policy import SETTLE_STEPS, BatchGuard, LoadPolicy
from ..prefix_cache import chunks_exact, prefill
from ..sampling import choose, make_generator
from ..types import MAX_GUESSES, SamplingParams, SpecdecError
from .proposal import Sources
from .request import FAILED, BatcherStats, Request, logprobs
from .step import constrained, run_step

errors = logging.getLogger("specdec.batcher")  # each failure once, with the request ids it ended

class ContinuousBatcher:
    def __init__(self, model, eos_ids=(), sources: list[Drafter] | tuple = (), method: str = "", k_max: int = 8,
                 max_batch: int = 16, max_queue: int = 256, max_context: int | None = None, adaptive: bool = True,
                 thread: bool = True, shared: SamplingParams | None = None, fill_context: bool = False,
                 raise_errors: bool = False, policy: LoadPolicy | None = None, prefix_cache=None) -> None:
        """sources: the draft sources steps may take guesses from (specdec.methods' table builds
        them for `method`, the name stats show); none: plain decoding. thread: decode in a worker
        started here (False: the caller runs `run()`, best in the main thread). shared: the
        sampling settings every request shares with one generator (`Engine.generate`): rows verify
        in one call, keyed by `Request.key`, and sources draft with them (a draft model samples
        from its q); None (the server): each request its own, guesses greedy (one-hot q).
        fill_context: a request longer than the context decodes until it is full instead of being
        refused. raise_errors: failures are raised to `run()`'s caller (generate). adaptive: the
        cost model prices every step (False: k_max every step, `--fixed-k`). policy: the
        `LoadPolicy`, when its owner keeps what it learns (`Engine`); None: a new one. prefix_cache: a
        `prefix_cache.PrefixCache` that prompts take their computed prefixes from and leave theirs in
        (its owner keeps it between batches); None: none. Prompts prefill in exact chunks where the
        model allows it (`prefix_cache.chunks_exact`), cache or not; elsewhere in one call, and the
        cache is ignored."""
        for d in sources:  # (the protocol is all the scheduler reads: anything else is refused here)
            if not isinstance(d, Drafter):
                raise SpecdecError(f"a draft source must subclass specdec.drafters.Drafter (got {type(d).__name__})")
        # a tree source's node budget is its cap: a step verifies its whole tree (cut by the cost model)
        k_max = max([k_max] + [d.max_nodes for d in sources]) if sources and k_max else 0
        if not 0 <= k_max <= MAX_GUESSES:
            raise SpecdecError(f"a step verifies at most {MAX_GUESSES} guesses (longer steps are not verified bit for bit "
                               f"as plain decoding computes them); -k or a tree's --tree-nodes asks for {k_max}")
        self.model = model
        self.eos = set(int(e) for e in eos_ids)
        self.method = method or ("none" if not sources else "+".join(d.label for d in sources))
        self.shared, self.fill_context, self.raise_errors = shared, fill_context, raise_errors
        self.k_max = k_max
        self.max_batch = max_batch
        self.max_context = min(max_context or model.max_context, model.max_context)
        self.waiting: queue.Queue[Request] = queue.Queue(maxsize=max_queue)
        self.rows: list[Request] = []
        self.cache = model.new_cache(max_batch, self.max_context)
        # prompts prefill in exact chunks where the model allows (prefix_cache.py: the same numbers
        # whether a prefix is cached or not, so the cache never changes an answer)
        self.chunked = chunks_exact(model)
        self.prefix = prefix_cache if self.chunked else None
        self.slots = self.k_max  # guess slots a row may take in one step
        adaptive = adaptive and all(d.may_skip for d in sources)  # (a source that may not sit out drafts every step)
        self.policy = policy if policy is not None else LoadPolicy(self.k_max, adaptive)
        self.sources = Sources(list(sources), self.policy, self.k_max, shared, self.slots)
        for d in sources:
            d.begin([], shared, self.max_context)
        if self.k_max and self.policy.adaptive:
            self.sources.time_alone()
        # a measured backstop to the cost model in batches of 2+ rows (policy.BatchGuard)
        self.guard = BatchGuard() if self.policy.adaptive and self.k_max > 0 else None
        self.lock = threading.Lock()
        self.totals = BatcherStats()
        self._last_k = 0  # guess slots per row in the last step
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
                self.totals.cancelled += dropped
        self.waiting.put_nowait(req)
        with self.lock:
            self.totals.requests += 1
        self._wake.set()

    def stats(self) -> BatcherStats:
        with self.lock:
            out = self.totals.copy()
        out.batch, out.queued, out.draft_k = len(self.rows), self.waiting.qsize(), self._last_k
        return out

    def run(self, until: Callable[[], bool] | None = None, warm: bool = False) -> None:
        """Decode until `close()` (from another thread), until `until()` is true (checked between
        steps) or until a `drain()` has ended; warm: first `warm_up()`. `specdec serve` runs this
        in the main thread: a step launched from a second thread pays OpenMP wake-ups (2 cores:
        23.8 against 15.4 ms a step of the default model, benchmarks/thread_step.py)."""
        if warm and not self.ready.is_set():
            self.warm_up()
        self.ready.set()
        self._loop(until)

    def warm_up(self, steps: int = 12) -> float:
        """Decode one made-up, self-repeating request on this thread, so that the one-off costs of
        the first steps (kernel dispatch, buffers, allocator growth) do not land on the first
        client and every source and verification path runs; counters are restored, the cost model
        keeps what it measured. Returns seconds."""
        t0 = time.perf_counter()
        saved = self.totals.copy()
        self.policy.eager = True  # every source runs in the warm-up, timed or not
        prompt = [(7 * i) % 97 + 10 for i in range(24)] * 3
        done = threading.Event()
        room = self.max_context - len(prompt) - self.slots - 3
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

    @torch.inference_mode()
    def _fail_step(self, e: Exception) -> None:
        """A step failed outside any one row's work (the shared forward): its rows end with an
        error (logged once, with their ids), the cache and sources start empty, serving goes on."""
        ids = [r.id for r in self.rows]
        errors.error("decode step failed; ending its requests %s: %s: %s", ids, type(e).__name__, e, exc_info=e)
        for r in self.rows:
            self._finish(r, "error")
        self.rows = []
        self.cache.lengths.zero_()
        try:
            self.sources.keep_rows([])
        except Exception:  # noqa: BLE001 - already failing: the log has the first error
            errors.exception("resetting the draft sources after a failed step failed too")

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
        """One request failed in its own work (prefill, verification, its stop check): it ends
        alone with reason "error", logged once with its id."""
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
        if self.chunked:  # in exact chunks, from the prompt's cached prefix if any (prefix_cache.py)
            logits, hidden, req.stats.cached_tokens = prefill(
                self.model, req.prompt, one, self.prefix, all_logits=req.prompt_logprobs is not None,
                need_hidden=self.sources.needs_hidden)
        else:
            at = torch.arange(L)[None] if req.prompt_logprobs is not None else torch.tensor([[L - 1]])
            logits, hidden = self.model(torch.tensor([req.prompt]), torch.arange(L)[None], one, logits_at=at)
        with self.lock:
            self.totals.prompt_tokens += L
            self.totals.cached_tokens += req.stats.cached_tokens
        if req.prompt_logprobs is not None:
            req.prompt_lps = [None] + logprobs(logits[0, :-1], req.prompt[1:], req.prompt_logprobs)
        if req.score_only:
            self._finish(req, "length")
            return
        last = constrained(logits[:, -1:], [req.constraint], [[[]]])[:, 0]
        first = int(choose(last, req.params, req.generator, rows=[req.key], positions=[L])[0])
        slot = len(self.rows)
        self.sources.join(RowInfo(list(req.prompt), req.params, self.max_context, req.prediction, req.constraint))
        if self.sources.needs_hidden:
            self.sources.keep_features(req, hidden[0, :L])
        if one is not self.cache:
            self.cache.fill_row(slot, one)
        req.context = list(req.prompt) + [first]
        req.first_token_s = time.perf_counter() - req.submitted
        self.rows.append(req)
        if self.log is not None:
            self.log.debug("prefill: %d tokens (%d cached), row %d, %.1f ms", L, req.stats.cached_tokens, slot,
                           (time.perf_counter() - t0) * 1e3)
        with self.lock:
            self.totals.first_tokens += 1
        self._emit(req, [first], logprobs(logits[0, -1:], [first], req.logprobs))
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
        if req.constraint is not None and cut:
            req.constraint.advance([t for t in cut if t not in self.eos])
        with self.lock:
            self.totals.tokens += len(cut)
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
            setattr(self.totals, kind, getattr(self.totals, kind) + 1)
        st = req.stats
        st.new_tokens, st.finish_reason = len(req.tokens), reason
        if req.decode_start is not None:
            st.decode_s = time.perf_counter() - req.decode_start
        try:
            req.on_done(reason, dict(prompt_tokens=len(req.prompt), completion_tokens=len(req.tokens),
                                     proposed=st.proposed, accepted=st.accepted, forwards=st.target_forwards,
                                     first_token_s=req.first_token_s, sources=dict(st.sources),
                                     cached_tokens=st.cached_tokens))
        except Exception:  # noqa: BLE001 - the owner's problem, not the batch's
            errors.exception("request %s: its on_done callback failed", req.id or "(no id)")

    @torch.inference_mode()
    def _remove(self, i: int, reason: str) -> None:
        """Row i leaves; the last active row moves into its slot. In inference mode, as the steps
        are, whoever calls it (end_all, a failed prefill's _fail_row run outside them): a step over
        the whole batch leaves the cache's row lengths an inference tensor, updated in place here."""
        req = self.rows[i]
        last = len(self.rows) - 1
        self.sources.finish(i, req.context)
        self.cache.move_row(last, i)
        self.rows[i] = self.rows[last]
        self.rows.pop()
        keep = list(range(last))
        if i != last:
            keep[i] = last
        self.sources.keep_rows(keep)
        self._finish(req, reason)

    @torch.inference_mode()
    def _step(self) -> None:
        """One step for every row: propose, score in one target forward, verify, commit or roll
        back, record, stream, let finished rows leave (a row whose own work fails ends alone)."""
        for i in reversed(range(len(self.rows))):  # drop cancelled rows first
            if self.rows[i].cancelled:
                self._remove(i, "cancelled")
        if not self.rows:
            return
        threads.tick()  # follow the cores other processes leave free (threads.py), as generate does
        t0 = time.perf_counter()
        A = len(self.rows)
        space = [self.max_context - len(r.context) - 2 for r in self.rows]  # cache slots a step may fill
        room = [min(r.params.max_new_tokens - len(r.tokens) - 1, free) for r, free in zip(self.rows, space)]
        plan = self.sources.plan(self.rows, self.totals.steps, room, self.guard, space)
        draft = plan.draft()
        t1 = time.perf_counter()
        cache = self.cache.first_rows(A)
        shared = self.shared is not None  # one setting and generator: one verification call for every row
        params = self.shared if shared else [r.params for r in self.rows]
        generators = self.rows[0].generator if shared else [r.generator for r in self.rows]
        res = run_step(self.model, cache, [r.context[-1] for r in self.rows], draft, params, generators, room,
                       [p is not None for p in plan.parents], row_keys=[r.key for r in self.rows],
                       constraints=[r.constraint for r in self.rows],
                       argmax_only=[r.params.greedy and r.logprobs is None for r in self.rows])
        if cache is not self.cache:
            cache.sync()
        counts_l, failed = draft.counts.tolist(), res.failed
        # how deep each row's proposal reached (a tree as deep as the tree)
        depths = [res.proposed_depth(b, c) for b, c in enumerate(counts_l)]
        self.sources.commit(plan, res.paths, depths, res.odds)
        t2 = time.perf_counter()
        self._record(plan, draft, res.accepted, t2 - t0)
        for b, r in enumerate(self.rows):
            if b in failed:
                continue
            # the output rows behind the committed tokens (a chain's are the first ones: a view)
            kept, ids = res.kept(b), res.ids(b, plan.guesses[b])
            if self.sources.needs_hidden:
                self.sources.keep_features(r, res.hidden[b, kept])
            r.context.extend(ids)
            st, accepted = r.stats, len(res.paths[b])
            st.target_forwards += 1
            st.proposed += depths[b]
            st.accepted += accepted
            if depths[b]:
                st.add_position_counts(depths[b], accepted)
                name = self.sources.drafters[plan.source[b]].label
                tally = st.sources.setdefault(name, [0, 0])
                tally[0] += depths[b]
                tally[1] += accepted
            else:
                why = plan.reason or "row"
                st.plain_steps[why] = st.plain_steps.get(why, 0) + 1
            st.draft_s += t1 - t0
            st.verify_s += t2 - t1
            try:
                self._emit(r, ids, logprobs(res.logits[b, kept], ids, r.logprobs) if r.logprobs is not None else None)
            except Exception as e:  # noqa: BLE001 - its owner's callback failed: this row alone ends
                failed[b] = e
        self._leave(failed)

    def _record(self, plan, draft, accepted: list[int], dt: float) -> None:
        """The step's time into the cost model and the guard; the counters; the debug line."""
        A, K = plan.A, draft.tokens.shape[1]
        # drafting is priced separately (and what it leaves the next steps: LoadPolicy.observe_step)
        drafted = next((self.sources.stats[i] for i in plan.drafted), None)
        settling = all(r.stats.target_forwards < SETTLE_STEPS for r in self.rows)
        self.policy.observe_step(A, K, dt - plan.t_draft, drafted, settling)
        if self.guard is not None:
            # (a step in which a source caught up on a prompt that just joined, or on steps it sat
            # out, is a one-off, not the steady cost of speculating: the guard does not count it)
            self.guard.observe(A, plan.k > 0, self.guard.progress(plan.room, accepted), dt, steady=plan.steady,
                               declined=plan.k == 0 and plan.reason == "cost")
        self._last_k = K
        if self.log is not None:
            used = sorted({self.sources.drafters[s].label for s, g in zip(plan.source, plan.guesses) if s is not None and g})
            self.log.debug("step: batch %d, draft cap %d, guesses %d, accepted %d, %.1f ms%s%s", A, plan.k,
                           int(draft.counts.sum()), sum(accepted), dt * 1e3,
                           f" (plain: {plan.reason})" if plan.reason else "",
                           f" [{', '.join(used)}{', probe' if plan.probe else ''}]" if used else "")
        with self.lock:
            t = self.totals
            t.steps += 1
            t.forwards += A
            t.proposed += int(draft.counts.sum())
            t.accepted += sum(accepted)
            if not K:
                t.plain_steps[plan.reason or "cost"] = t.plain_steps.get(plan.reason or "cost", 0) + 1
            for s, g in zip(plan.source, plan.guesses):
                if s is not None and g:
                    name = self.sources.drafters[s].label
                    t.source_rows[name] = t.source_rows.get(name, 0) + 1

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
