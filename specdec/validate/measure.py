"""The measurements behind `specdec validate`, on the user's samples.

1. `acceptance`: every sample decoded greedily at batch 1 with plain decoding (`none`, the
   oracle) and with each speculative configuration, interleaved per sample; per sample and
   overall: acceptance alpha, tokens per target forward tau, acceptance by draft position,
   draft / verify / other time, and whether the output equals plain decoding token for token.
2. `load`: the batched engine the server uses (`core.scheduler.ContinuousBatcher`, the model
   in the calling thread as `specdec serve` runs it; the server's drafting: prompt lookup, or
   prompt lookup + the EAGLE head where the target has one) with
   speculation off, at a fixed draft length, and load-aware, driven by C client threads at
   each concurrency C: time to first token, time per output token p50/p95 (over requests),
   inter-token latency p50/p95 (over deliveries), throughput, and
   whether each greedy answer equals plain decoding.
3. `distribution`: for a few samples, many seeded sampled continuations of the first tokens
   with speculation, compared with the target's exact probabilities from plain forwards
   (chi-square over the frequent prefixes, and a probability-integral-transform test over
   every token speculation produced).

This module runs models and counts; `analysis.py` turns the counts into figures and a
verdict, `report.py` writes them. It knows nothing about files or the command line.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, replace

import torch

from ..drafters.suffix import forget_shared
from ..types import SamplingParams


@dataclass
class Config:
    """One speculative configuration under test."""

    name: str  # e.g. "ngram k=8", "eagle tree"
    method: str
    k: int | None  # draft length (chains) or tree depth (trees)
    tree: bool
    engine: object  # engine.Engine


def _row(res) -> dict:
    s = res.stats
    return {"new_tokens": s.new_tokens, "forwards": s.target_forwards, "proposed": s.proposed,
            "accepted": s.accepted, "proposed_by_pos": list(s.proposed_by_pos),
            "accepted_by_pos": list(s.accepted_by_pos), "prefill_s": s.prefill_s, "decode_s": s.decode_s,
            "draft_s": s.draft_s, "verify_s": s.verify_s, "alpha": s.alpha, "tau": s.tau,
            "finish": s.finish_reason}


def acceptance(configs: list[Config], none_engine, encoded: list[list[int]], params: SamplingParams,
               repeats: int, bar=None) -> dict:
    """Greedy runs of `none` and every config on every sample, `repeats` times, interleaved.

    Returns {"none": {...}, config name: {...}} where each entry holds `samples` (per sample,
    from the first repeat: counts, times, tokens) and `reps` (per repeat: summed new tokens,
    prefill, decode, draft and verify seconds)."""
    runs = [("none", none_engine)] + [(c.name, c.engine) for c in configs]
    out = {name: {"samples": [], "reps": [dict(new_tokens=0, prefill_s=0.0, decode_s=0.0, draft_s=0.0, verify_s=0.0)
                                          for _ in range(repeats)]} for name, _ in runs}
    for rep in range(repeats):
        for ids in encoded:
            for name, eng in runs:
                forget_shared()  # no suffix drafts from this sample's earlier answers (another repeat, config)
                [res] = eng.generate([ids], params)
                acc = out[name]["reps"][rep]
                acc["new_tokens"] += res.stats.new_tokens
                for key in ("prefill_s", "decode_s", "draft_s", "verify_s"):
                    acc[key] += getattr(res.stats, key)
                if rep == 0:
                    row = _row(res)
                    row["tokens"] = list(res.tokens)
                    out[name]["samples"].append(row)
                if bar is not None:
                    bar.update(1)
    ref = [r["tokens"] for r in out["none"]["samples"]]
    for name, _ in runs:
        for r, want in zip(out[name]["samples"], ref):
            r["equal"] = r["tokens"] == want
            if not r["equal"]:
                r["first_difference"] = next((i for i, (a, b) in enumerate(zip(r["tokens"], want)) if a != b),
                                             min(len(r["tokens"]), len(want)))
    return out


# ---------------------------------------------------------------------------------------------
def _quantile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    i = q * (len(s) - 1)
    lo = int(i)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (i - lo)


def drive(batcher, prompts: list[list[int]], conc: int, per_client: int, params: SamplingParams,
          reference: list[list[int]] | None = None, timeout: float = 600.0) -> dict:
    """C client threads, each submitting `per_client` requests back to back (prompts taken in
    turn). Returns throughput; time to first token (p50); time per output token (TPOT: a
    request's time from its first to its last token / its tokens after the first; p50 and p95
    over requests), the latency a reader of the stream sees; inter-token latency (ITL: each gap
    between deliveries / the tokens delivered; p50, p95), which hides speculation's gain since
    most deliveries still carry one token; failures; and how many answers equal `reference`
    (the plain greedy outputs of the same prompts)."""
    from ..core.scheduler import Request

    lock = threading.Lock()
    ttft, tpot, gaps, tokens, failures, equal, checked = [], [], [], [0], [], [0], [0]

    def client(c: int) -> None:
        for j in range(per_client):
            idx = (c * per_client + j) % len(prompts)
            done = threading.Event()
            state = {"t0": time.perf_counter(), "first": None, "last": None, "reason": None, "ids": []}

            def on_tokens(ids, state=state):
                now = time.perf_counter()
                with lock:
                    if state["last"] is None:
                        ttft.append(now - state["t0"])
                        state["first"] = now
                    else:
                        gaps.extend([(now - state["last"]) / len(ids)] * len(ids))
                    tokens[0] += len(ids)
                state["last"] = now
                state["ids"].extend(ids)

            def on_done(reason, stats, state=state, done=done):
                state["reason"] = reason
                done.set()

            req = Request(list(prompts[idx]), params, on_tokens, on_done)
            try:
                batcher.submit(req)
            except Exception as e:  # noqa: BLE001 - counted and reported
                with lock:
                    failures.append(f"submit: {type(e).__name__}: {e}")
                continue
            if not done.wait(timeout):
                req.cancel()
                with lock:
                    failures.append("timed out")
                continue
            with lock:
                if state["reason"] not in ("eos", "length", "stop"):
                    failures.append(str(state["reason"]))
                    continue
                if len(state["ids"]) > 1:
                    tpot.append((state["last"] - state["first"]) / (len(state["ids"]) - 1))
                if reference is not None:
                    checked[0] += 1
                    equal[0] += state["ids"] == reference[idx]

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(conc)]
    for t in threads:
        t.start()
    if batcher.thread is None:  # the model runs here, in the calling (main) thread, as `specdec serve` runs it
        batcher.run(until=lambda: not any(t.is_alive() for t in threads))
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"throughput": tokens[0] / wall if wall else 0.0, "ttft_p50": statistics.median(ttft) if ttft else 0.0,
            "token_p50": _quantile(tpot, 0.5), "token_p95": _quantile(tpot, 0.95),
            "itl_p50": _quantile(gaps, 0.5), "itl_p95": _quantile(gaps, 0.95), "tokens": tokens[0],
            "requests": conc * per_client, "failures": failures, "equal": equal[0], "checked": checked[0],
            "wall": wall}


LOAD_SETTINGS = ("off", "fixed", "adaptive")
WARM_TOKENS = 24  # the answers' length in a level's unmeasured first burst (`load`)


def load_settings(settings) -> list[str]:
    """The load test's settings in their order: "off" (the baseline) and those of `settings`."""
    return [name for name in LOAD_SETTINGS if name == "off" or name in settings]


def load(model, eos_ids, encoded: list[list[int]], params: SamplingParams, levels: list[int], k: int,
         min_requests: int, repeats: int, reference: list[list[int]] | None = None, bar=None,
         make_sources=None, method: str | None = None, settings: tuple[str, ...] = LOAD_SETTINGS) -> dict:
    """Off / fixed-k / load-aware speculation through the server's batcher (`settings`, of
    LOAD_SETTINGS; "off" always), each concurrency level run for every setting in turn, `repeats`
    rounds; medians per (setting, level). Each level sends at least `min_requests` requests. The
    drafting is the server's: `make_sources()` (new draft sources per call) under `method` (the
    server's `auto` by default), or prompt lookup alone without it, as `specdec serve --method`
    runs them.

    Measured warm, as a running server is: before its first measured burst of a level, each
    setting answers one unmeasured burst of that size (short answers), so the batch guard has
    met the batch size and the cost model its step times; a single cold burst of 4 requests,
    ~1 s, charged the adaptive setting its first probes of a new batch size (0.86-0.94 of off
    on a 2-core Xeon where warm bursts gave 0.99-1.04). The settings' order alternates from one
    (round, level) to the next (off first, then last): a burst that runs right after another
    setting's ran up to ~5% slower on a shared machine, which a fixed order charged to one side."""
    from ..core.scheduler import ContinuousBatcher
    from ..drafters.ngram import NgramDrafter

    ctx = min(model.max_context, max(len(p) for p in encoded) + params.max_new_tokens + k + 8)
    if make_sources is None:
        method, make_sources = "ngram", lambda: [NgramDrafter()]
    method = method or "auto"
    spec = {"off": ("none", False), "fixed": (method, False), "adaptive": (method, True)}
    spec = {name: spec[name] for name in load_settings(settings)}
    batchers = {name: ContinuousBatcher(model, eos_ids, make_sources() if m != "none" else [], method=m, k_max=k,
                                        max_batch=max(levels), max_context=ctx, adaptive=ad, thread=False)
                for name, (m, ad) in spec.items()}
    raw = {name: {c: [] for c in levels} for name in spec}
    chosen_k = {name: {c: [] for c in levels} for name in spec}
    warm = replace(params, max_new_tokens=min(params.max_new_tokens, WARM_TOKENS))
    try:
        for rnd in range(repeats):
            for i, c in enumerate(levels):
                per_client = max(1, -(-min_requests // c))
                order = list(batchers.items())
                if (rnd + i) % 2:
                    order.reverse()
                for name, b in order:
                    if rnd == 0:  # this batch size's first burst, unmeasured (prompts from the end)
                        drive(b, encoded[::-1], c, 1, warm)
                        if bar is not None:
                            bar.update(1)
                    forget_shared()  # no suffix drafts from the answers an earlier level or setting gave
                    before = b.stats()
                    res = drive(b, encoded, c, per_client, params, reference)
                    after = b.stats()
                    guesses = after.proposed - before.proposed
                    rows = after.forwards - before.forwards
                    res["mean_guesses"] = guesses / rows if rows else 0.0
                    res["alpha"] = ((after.accepted - before.accepted) / guesses) if guesses else 0.0
                    raw[name][c].append(res)
                    chosen_k[name][c].append(res["mean_guesses"])
                    if bar is not None:
                        bar.update(1)
    finally:
        for b in batchers.values():
            b.close()
    table = {}
    for name in spec:
        table[name] = {}
        for c in levels:
            rs = raw[name][c]
            row = {key: statistics.median(r[key] for r in rs)
                   for key in ("throughput", "ttft_p50", "token_p50", "token_p95", "itl_p50", "itl_p95",
                               "mean_guesses", "alpha")}
            row["failures"] = sum(len(r["failures"]) for r in rs)
            row["failure_examples"] = [f for r in rs for f in r["failures"]][:3]
            row["requests"] = sum(r["requests"] for r in rs)
            row["equal"] = sum(r["equal"] for r in rs)
            row["checked"] = sum(r["checked"] for r in rs)
            table[name][c] = row
    return {"k": k, "levels": levels, "repeats": repeats, "min_requests": min_requests, "table": table,
            "settings": list(spec),
            "drafting": DRAFTING.get(method, f"method {method}")}


DRAFTING = {"auto": "prompt lookup + suffix cache + EAGLE tree", "ngram": "prompt lookup"}  # the load test's drafting, in words


# ---------------------------------------------------------------------------------------------
def exact_probs(model, seqs: list[list[int]], temperature: float, batch: int = 32,
                prompt: list[int] | None = None) -> torch.Tensor:
    """The target's next-token distributions after each sequence (all of one length) at
    `temperature`: plain forwards (no speculation), softmax(logits / T) in float64. [len(seqs), V].
    With `prompt` (a prefix every sequence starts with) and a native model, the prompt is
    prefilled once and each chunk of sequences forwards only what follows it from a copy of that
    cache (what plain decoding computes); otherwise every sequence is one forward from scratch."""
    L = len(seqs[0]) if seqs else 0
    base = None
    if prompt and getattr(model, "native", False) and len(prompt) < L:
        base = model.new_cache(1, len(prompt))
        with torch.inference_mode():
            model(torch.tensor([prompt]), torch.arange(len(prompt))[None], base,
                  logits_at=torch.zeros(1, 0, dtype=torch.long))
    out = []
    for i in range(0, len(seqs), batch):
        chunk = seqs[i:i + batch]
        n = len(chunk)
        start = 0
        cache = model.new_cache(n, L + 1)
        if base is not None:
            start = len(prompt)
            for layer in range(len(base.k)):
                cache.k[layer][:, :, :start] = base.k[layer][:, :, :start]
                cache.v[layer][:, :, :start] = base.v[layer][:, :, :start]
            cache.lengths[:] = start
        with torch.inference_mode():
            logits, _ = model(torch.tensor([s[start:] for s in chunk]),
                              torch.arange(start, L)[None].expand(n, L - start), cache,
                              logits_at=torch.full((n, 1), L - start - 1))
        out.append(torch.softmax(logits[:, 0].double() / temperature, dim=-1))
    return torch.cat(out)


def chi_square(counts: dict[int, int], probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson chi-square of observed token counts against exact probabilities: tokens expected
    at least `min_expected` times are their own cells, the rest share one cell."""
    n = sum(counts.values())
    expected = probs * n
    big = torch.nonzero(expected >= min_expected).flatten().tolist()
    cells_e = [float(expected[i]) for i in big]
    cells_o = [counts.get(i, 0) for i in big]
    rest_e = n - sum(cells_e)
    rest_o = n - sum(cells_o)
    if rest_e >= min_expected or (rest_e > 1e-9 and not cells_e):
        cells_e.append(rest_e)
        cells_o.append(rest_o)
    elif cells_e and rest_e > 1e-12:  # too small for a cell of its own: fold into the smallest
        j = min(range(len(cells_e)), key=lambda i: cells_e[i])
        cells_e[j] += rest_e
        cells_o[j] += rest_o
    elif rest_o > 0:  # tokens observed that the target gives (almost) no mass: certain failure
        return float("inf"), max(1, len(cells_e))
    stat = sum((o - e) ** 2 / e for o, e in zip(cells_o, cells_e) if e > 0)
    return stat, max(0, len(cells_e) - 1)


def chi2_pvalue(stat: float, dof: int) -> float:
    if dof <= 0:
        return 1.0
    if stat == float("inf"):
        return 0.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def pit(token: int, probs: torch.Tensor, u: float) -> float:
    """Randomised probability integral transform of a sampled token: with the tokens ordered
    from most to least probable, F(before token) + u * p(token). Uniform on (0, 1) exactly when
    the token was drawn from `probs`; mass moved towards likely tokens (a typical broken
    rejection rule over-accepts the draft's favourites) pushes it towards 0."""
    p = probs[token]
    ties = (probs == p) & (torch.arange(len(probs)) < token)  # equal probabilities: lower ids first
    before = float(probs[probs > p].sum()) + float(probs[ties].sum())
    return min(1.0, before + u * float(p))


def check_sequences(model, prompt: list[int], seqs: list[list[int]], temperature: float, seed: int = 0,
                    min_group: int = 30, bins: int = 10) -> dict:
    """Compare sampled continuations with the target's exact conditionals p(. | prompt, prefix),
    from plain forwards over every distinct prefix that was sampled.

    Two tests, each must hold: (1) grouped chi-square: for each position t, sequences grouped
    by their first t tokens, every group of at least `min_group` tested cell by cell, the
    statistics and degrees of freedom summed; (2) for the tokens after the first (the ones
    speculation produced; the first comes from the prefill), the randomised PIT values of all
    of them, binned, against the uniform distribution. (2) uses every speculated token even
    where prefixes are too diverse for (1)."""
    gen = torch.Generator().manual_seed(seed)
    stat, dof, groups, tested = 0.0, 0, 0, 0
    tv_first = None
    u_values: list[float] = []
    depth = max((len(s) for s in seqs), default=0)
    for t in range(depth):
        by_prefix: dict[tuple, dict[int, int]] = {}
        for s in seqs:
            if len(s) > t:
                cell = by_prefix.setdefault(tuple(s[:t]), {})
                cell[s[t]] = cell.get(s[t], 0) + 1
        prefixes = list(by_prefix)
        probs = exact_probs(model, [list(prompt) + list(pf) for pf in prefixes], temperature, prompt=list(prompt))
        for pf, p in zip(prefixes, probs):
            counts = by_prefix[pf]
            n = sum(counts.values())
            if t >= 1:
                for tok, c in counts.items():
                    u_values += [pit(tok, p, float(x)) for x in torch.rand(c, generator=gen, dtype=torch.float64)]
            if n < min_group:
                continue
            s_, d_ = chi_square(counts, p)
            stat += s_
            dof += d_
            groups += 1
            tested += n
            if t == 0:
                emp = torch.zeros_like(p)
                for tok, c in counts.items():
                    emp[tok] = c / n
                tv_first = float(0.5 * (emp - p).abs().sum())
    out = {"chi2": stat, "dof": dof, "p_value_grouped": chi2_pvalue(stat, dof), "groups": groups,
           "tokens_tested": tested, "tv_first_token": tv_first, "speculated_tokens": len(u_values)}
    if len(u_values) >= 5 * bins:
        hist = torch.histc(torch.tensor(u_values), bins=bins, min=0.0, max=1.0)
        e = len(u_values) / bins
        pit_stat = float(((hist - e) ** 2 / e).sum())
        out.update(pit_chi2=pit_stat, pit_p_value=chi2_pvalue(pit_stat, bins - 1), pit_histogram=hist.tolist())
    else:
        out.update(pit_chi2=None, pit_p_value=None, pit_histogram=None)
    ps = [x for x in (out["p_value_grouped"] if dof else None, out["pit_p_value"]) if x is not None]
    out["p_value"] = min(ps) if ps else 1.0
    out["tests"] = len(ps)
    return out


def always_drafting(engine, model=None):
    """An engine with `engine`'s sources drafting k guesses at every step (a fixed k), for the
    distribution check: a priced source may stop guessing where guesses rarely hold, which would
    leave nothing to check, and a seeded sample under the cost model takes deterministic guesses,
    while at a fixed k a source that samples its guesses draws them from its q, the case the check
    must see. `model`: the target to run (default: the engine's; a PromptOnce around it)."""
    from ..engine import Engine

    if not engine.sources and model is None:
        return engine
    return Engine(model or engine.model, engine.sources, k=engine.k, eos_ids=engine.eos_ids,
                  fixed_k=bool(engine.sources), method=engine.method)


class PromptOnce:
    """A native target whose prefill of `prompt` into an empty one-row cache is computed once: later
    prefills of the same prompt take a copy of its cache entries and outputs, the same numbers (a
    forward is deterministic), so the distribution check's hundreds of draws from one prompt pay
    one prefill instead of one each. Every other call and attribute goes to the model."""

    def __init__(self, model, prompt: list[int]) -> None:
        self._model, self._prompt, self._saved = model, list(prompt), None

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, tokens, positions, cache, attn_mask=None, logits_at=None):
        L = len(self._prompt)
        if not (attn_mask is None and logits_at is not None and tuple(tokens.shape) == (1, L)
                and getattr(cache, "batch_size", None) == 1 and int(cache.lengths[0]) == 0
                and tokens[0].tolist() == self._prompt and positions.reshape(-1).tolist() == list(range(L))
                and logits_at.tolist() == [[L - 1]]):
            return self._model(tokens, positions, cache, attn_mask=attn_mask, logits_at=logits_at)
        if self._saved is None:
            logits, hidden = self._model(tokens, positions, cache, logits_at=logits_at)
            self._saved = ([k[:, :, :L].clone() for k in cache.k], [v[:, :, :L].clone() for v in cache.v],
                           logits.clone(), None if hidden is None else hidden.clone())
            return logits, hidden
        keys, values, logits, hidden = self._saved
        for layer, (k, v) in enumerate(zip(keys, values)):
            cache.k[layer][:, :, :L] = k
            cache.v[layer][:, :, :L] = v
        cache.lengths[:] = L
        return logits.clone(), None if hidden is None else hidden.clone()


#: draws that caught a subtle mistake (a rejected guess resampled from p, not the residual) in every seed of
#: benchmarks/dist_power.py; fewer catch gross errors but may miss such ones (docs/validate.md)
THOROUGH_DRAWS = 800


def distribution(config: Config, model, prompt: list[int], draws: int, tokens: int, temperature: float, seed: int,
                 batch: int = 32, alpha_level: float = 1e-3) -> dict:
    """`draws` seeded sampled continuations of `tokens` tokens with speculation (rows of `batch`,
    drafting at every step: `always_drafting`, the prompt prefilled once: `PromptOnce`), checked
    against the exact conditionals. The first token comes from the prefill; speculation acts from
    the second on, so `proposed` says how many guesses were actually verified."""
    seqs, proposed, accepted = [], 0, 0
    params = SamplingParams(temperature=temperature, max_new_tokens=tokens)
    target = config.engine.model
    engine = always_drafting(config.engine, PromptOnce(target, prompt) if getattr(target, "native", False) else None)
    for start in range(0, draws, batch):
        n = min(batch, draws - start)
        res = engine.generate([prompt] * n, replace(params, seed=seed + start))
        for r in res:
            seqs.append(list(r.tokens))
            proposed += r.stats.proposed
            accepted += r.stats.accepted
    out = check_sequences(model, prompt, seqs, temperature, seed)
    # each of the (at most two) tests at alpha_level / tests (Bonferroni)
    level = alpha_level / max(1, out["tests"])
    out.update(draws=draws, tokens=tokens, temperature=temperature, seed=seed, proposed=proposed, accepted=accepted,
               alpha_level=alpha_level, tested=out["tests"] > 0, passed=out["p_value"] >= level,
               exercised=proposed > 0 and out["pit_p_value"] is not None)
    return out
