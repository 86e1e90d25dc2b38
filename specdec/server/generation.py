"""One HTTP request's choices on the batcher: submit them, follow their tokens, answer.

A `Job` is one request's choices (one per prompt and per `n`), each a batcher `Request` whose
callbacks (on the model thread) decode its text (a `TextStream` per choice, which is also the
request's stop_fn) and put (choice, kind, payload) events into an asyncio queue on the event
loop: the new tokens with the text they add, then the end with the text held back till then. `collect` waits for every choice to end (a non-streaming answer); `events`
yields them as they come (a stream). A client that leaves cancels its choices at once: a
watcher task waits for the connection's disconnect message (non-streaming), and Starlette
cancels a stream's generator when its client goes (its `finally` cancels the rows). A choice
that fails in the batcher fails this request alone: a 500 (or an error event in a stream);
at shutdown, a 503 (or an error event), and each stream still ends with `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import queue
import time
from dataclasses import dataclass, field

from ..text import TextStream
from ..types import SamplingParams, SpecdecError
from ..core.scheduler import FAILED, Request
from .errors import APIError, internal_error

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


@dataclass
class Choice:
    prompt_ids: list[int]
    echo: str | None  # the prompt's text in front of the answer (completions' echo)
    request: Request
    decoder: TextStream  # fed on the model thread; read here once the choice ended (and its `ends`
    # below the count an event carried: an append-only list)
    tokens: list[int] = field(default_factory=list)
    lps: list = field(default_factory=list)
    unsent: str = ""  # text that arrived and was not streamed yet
    within: int = 0  # tokens wholly inside the text that arrived (with logprobs)
    reason: str | None = None  # the batcher's finish reason, once ended
    stats: dict = field(default_factory=dict)

    def finish_reason(self) -> str:
        """OpenAI's finish reason: "stop" for a stop string or the end of text, else "length"."""
        return "stop" if self.decoder.stopped else FINISH_REASONS.get(self.reason, self.reason)


@dataclass
class Job:
    rid: str
    choices: list[Choice]
    out: asyncio.Queue
    stops: list[str]
    t0: float
    timeout: float
    prompt_tokens: int = 0  # each prompt once, whatever n
    n: int = 1  # choices per prompt (choice p * n + j: prompt p's j-th)
    disconnected: bool = False
    shaping: object = None  # structured.Shaping: grammar, prediction, tool syntax (None: none)

    def cancel(self) -> None:
        for c in self.choices:
            if c.reason is None:
                c.request.cancel()

    def cached_tokens(self) -> int:
        """Prompt tokens taken from the prefix cache, each prompt once as prompt_tokens counts them
        (the least of its choices: a prompt's later choices find what its first one left)."""
        n = max(self.n, 1)
        return sum(min(c.stats.get("cached_tokens", 0) for c in self.choices[p:p + n])
                   for p in range(0, len(self.choices), n))

    def remaining(self) -> float:
        return self.timeout - (time.perf_counter() - self.t0)


def submit(state, prompts: list[tuple[list[int], str | None]], params: SamplingParams, n: int, stops: list[str],
           spec: tuple[int | None, frozenset | None], top: int | None, rid: str, prompt_top: int | None = None,
           score_only: bool = False, shaping=None) -> Job:
    """Queue one batcher request per prompt and per n (choice p * n + j samples with seed + j, so a
    prompt gives the same text alone or batched). prompts: (token ids, echoed text or None).
    shaping (structured.Shaping): each choice carries the prediction and its own grammar state."""
    spec_k, sources = spec
    choices = len(prompts) * n
    if choices > state.batcher.waiting.maxsize:  # it would get 429 however long it waited
        raise APIError(400, f"this request has {choices} choices (prompts x n) but the server queues at most "
                            f"{state.batcher.waiting.maxsize} (--max-queue); send fewer prompts or a smaller n",
                       param="n")
    loop = asyncio.get_running_loop()
    job = Job(rid, [], asyncio.Queue(), stops, time.perf_counter(), state.request_timeout,
              prompt_tokens=sum(len(ids) for ids, _ in prompts), n=n, shaping=shaping)

    for ids, echo in prompts:
        for j in range(n):
            i = len(job.choices)
            p = params if params.seed is None or j == 0 else SamplingParams(**{**params.__dict__, "seed": params.seed + j})
            decoder = TextStream(state.text.tok, stops, token_ends=top is not None)

            def on_tokens(new, lps=None, i=i, decoder=decoder):
                piece = decoder.push(new)
                within = decoder.tokens_within(decoder.shown) if decoder.ends is not None else 0
                loop.call_soon_threadsafe(job.out.put_nowait, (i, "tokens", (list(new), lps, piece, within)))

            def on_done(reason, stats, i=i, decoder=decoder):
                if reason != "cancelled" and reason not in FAILED:  # the batcher counted it finished
                    state.metrics.observe_finished(time.perf_counter() - job.t0, stats)
                rest = decoder.finish()
                within = decoder.tokens_within(decoder.shown) if decoder.ends is not None else 0
                loop.call_soon_threadsafe(job.out.put_nowait, (i, "done", (reason, stats, rest, within)))

            r = Request(list(ids), p, on_tokens, on_done, stop_fn=decoder.reached_stop if decoder.stops else None,
                        spec_k=spec_k, logprobs=top, sources=sources, prompt_logprobs=prompt_top,
                        score_only=score_only, id=f"{rid}/{i}", prediction=shaping.prediction if shaping else None,
                        constraint=shaping.constraint() if shaping else None)
            try:
                state.batcher.submit(r)
            except queue.Full:
                job.cancel()
                raise APIError(429, "the server is busy (request queue full); retry later", "rate_limit_error",
                               headers={"Retry-After": "1"})
            except SpecdecError as e:
                job.cancel()
                if state.batcher.draining:
                    raise APIError(503, str(e), "server_error", headers={"Retry-After": "5"})
                raise APIError(400, str(e), param="max_tokens")
            job.choices.append(Choice(list(ids), echo, r, decoder))
    return job


def apply(job: Job, event) -> tuple[int, str]:
    """Record one event on its choice; returns (choice index, kind)."""
    i, kind, payload = event
    c = job.choices[i]
    if kind == "tokens":
        new, lps, piece, c.within = payload
        c.tokens.extend(new)
        c.lps.extend(lps or [])
    else:
        c.reason, c.stats, piece, c.within = payload
    c.unsent += piece
    return i, kind


def failure(job: Job, reason: str) -> APIError | None:
    """The error a choice's finish reason means for the whole request, if any."""
    if reason == "error":
        return internal_error(job.rid)
    if reason == "shutdown":
        return APIError(503, "the server is shutting down; this request was not finished, retry it", "server_error",
                        headers={"Retry-After": "5"})
    return None


def timed_out(job: Job) -> APIError:
    return APIError(408, f"the request took longer than {job.timeout:.0f} s", "timeout_error")


async def watch_disconnect(http_request, job: Job) -> None:
    """Cancel the job's choices as soon as its client disconnects (the body has been read, so
    the next message on the connection is the disconnect)."""
    while True:
        message = await http_request.receive()
        if message.get("type") == "http.disconnect":
            job.disconnected = True
            job.cancel()
            job.out.put_nowait((None, "disconnect", None))
            return


async def collect(job: Job, http_request) -> bool:
    """Wait for every choice to end; False if the client left first. Raises the request's
    APIError for a timeout, a failed choice or a shutdown (cancelling the other choices)."""
    watcher = asyncio.create_task(watch_disconnect(http_request, job))
    try:
        while any(c.reason is None for c in job.choices):
            try:
                event = await asyncio.wait_for(job.out.get(), timeout=max(job.remaining(), 0.0))
            except asyncio.TimeoutError:
                raise timed_out(job) from None
            if event[1] == "disconnect":
                return False
            i, kind = apply(job, event)
            if kind == "done" and failure(job, job.choices[i].reason) is not None:
                raise failure(job, job.choices[i].reason)
        return True
    finally:
        watcher.cancel()
        job.cancel()  # timed out, failed or left: free the batch rows still running


async def events(job: Job):
    """(choice index, kind) as events arrive, until every choice ended; raises the request's
    APIError on a timeout, a failed choice or a shutdown. The caller cancels the job when done."""
    while any(c.reason is None for c in job.choices):
        try:
            event = await asyncio.wait_for(job.out.get(), timeout=max(job.remaining(), 0.0))
        except asyncio.TimeoutError:
            raise timed_out(job) from None
        i, kind = apply(job, event)
        if kind == "done" and failure(job, job.choices[i].reason) is not None:
            raise failure(job, job.choices[i].reason)
        yield i, kind
