"""What suffix decoding would accept on recorded traces, without a model or the scheduler.

Replays each recorded trace (benchmarks/data/agentic/<trace>.recorded.jsonl, from
`agentic_traces.py record`) request by request, in order, as one client sends them: every step a
source drafts from the row's context (prompt + committed output, the pending token last) and the
step accepts the longest path of the draft that the recorded output continues with (greedy
verification; for the sampled `samples` trace the same rule, sample-and-compare, holds for the
recorded seeds), then commits it and one more token. A finished request goes into the suffix
cache, so later requests draft from it. Reports per source and trace: accepted guesses per step,
tokens per step (accepted + 1, the target forwards saved), guesses verified per step (what the
steps cost beyond a plain one), and proposal time per step.

Sources: `suffix` (SuffixDrafter: trees), `suffix-chain` (its best path only), `lookup` (prompt
lookup as `--method ngram` drafts before its cost cut: `ngram.SuffixIndex`, n = 4..1, 8 guesses),
`arctic` / `arctic-chain` (Arctic Inference's SuffixDecodingCache, where it is installed, with
the same node budget and score floor). `--fill N` first fills the cache with N tokens of the
Python standard library's sources in requests of ~300 tokens (the default model's tokenizer),
for proposal time and memory at a realistic cache size.

    python benchmarks/suffix_replay.py --sources suffix,suffix-chain,lookup,arctic
    python benchmarks/suffix_replay.py --sources suffix,arctic --fill 1000000 --traces sql,tools
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import sysconfig
import time
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "agentic"
HERE = Path(__file__).resolve().parent


def load_trace(name: str) -> list[dict]:
    path = DATA / f"{name}.recorded.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path} is missing: run python benchmarks/agentic_traces.py record")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def accepted(tokens: list[int], parents: list[int] | None, truth: list[int]) -> int:
    """Guesses a greedy verification accepts: the longest root path whose tokens `truth` starts with."""
    if parents is None:
        parents = list(range(len(tokens)))
    node, depth = 0, 0
    while depth < len(truth):
        nxt = next((j for j, (t, p) in enumerate(zip(tokens, parents), start=1) if p == node and t == truth[depth]), None)
        if nxt is None:
            break
        node, depth = nxt, depth + 1
    return depth


def stdlib_fill(tokens: int) -> list[list[int]]:
    """`tokens` tokens of the standard library's .py sources (sorted, site-packages left out), as
    requests of ~300 tokens, tokenised by the default model's tokenizer."""
    from specdec.config import SpecConfig, load_target

    tok = load_target(SpecConfig(method="none"), True).tokenizer
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        ids = tok.encode(text, add_special_tokens=False)
        for i in range(0, len(ids), 300):
            out.append(ids[i:i + 300])
            total += len(out[-1])
            if total >= tokens:
                return out
    return out


class Suffix:
    def __init__(self, tree: bool, fill: list[list[int]], settings: dict | None = None) -> None:
        from specdec.drafters.suffix import SuffixCache, SuffixDrafter, SuffixParams

        self.cache = SuffixCache()
        for seq in fill:
            self.cache.insert([], seq)
        self.drafter = SuffixDrafter(self.cache, SuffixParams(**{"tree": tree, **(settings or {})}))
        self.drafter.begin([], None, 0)

    def start(self, prompt):
        self.drafter.add_row(0, prompt)

    def draft(self, context):
        from specdec.drafters.base import DraftContext
        from specdec.types import SamplingParams

        offer = self.drafter.offer(DraftContext([context], SamplingParams(), None), self.drafter.params.max_nodes)[0]
        return ([], None) if offer is None else (offer.tokens, offer.parents)

    def stop(self, prompt, output):
        self.drafter.finish_row(0, list(prompt) + list(output))
        self.drafter.keep_rows([])

    def memory(self):
        return self.cache.memory_bytes, self.cache.tokens


class Lookup:
    def __init__(self, fill) -> None:
        from specdec.drafters.ngram import SuffixIndex

        self.make = lambda: SuffixIndex(1, 4)

    def start(self, prompt):
        self.index = self.make()

    def draft(self, context):
        return self.index.match(context, 8)[1], None

    def stop(self, prompt, output):
        pass

    def memory(self):
        return 0, 0


class Arctic:
    """Arctic Inference's SuffixDecodingCache as vLLM's `suffix` method drives it: the prompt
    starts a request, committed tokens are added as they come, the request stops at its end."""

    def __init__(self, tree: bool, fill) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.cache = SuffixDecodingCache(max_tree_depth=64, max_cached_requests=1 << 20)
        self.tree, self.n = tree, 0
        for seq in fill:
            self.cache.start_request(("fill", self.n), [])
            self.cache.add_active_response(("fill", self.n), seq)
            self.cache.stop_request(("fill", self.n))
            self.n += 1

    def start(self, prompt):
        self.n += 1
        self.cache.start_request(self.n, prompt)
        self.sent = len(prompt)

    def draft(self, context):
        if len(context) > self.sent:
            self.cache.add_active_response(self.n, context[self.sent:])
            self.sent = len(context)
        d = self.cache.speculate(self.n, context, max_spec_tokens=24, max_spec_factor=2.0, min_token_prob=0.1,
                                 use_tree_spec=self.tree)
        return d.token_ids, [p + 1 for p in d.parents]

    def stop(self, prompt, output):
        self.cache.stop_request(self.n)

    def memory(self):
        return self.cache._global_tree.estimate_memory(), None


def make_source(name: str, fill, settings: dict):
    if name in ("suffix", "suffix-chain"):
        return Suffix(name == "suffix", fill, settings)
    if name == "lookup":
        return Lookup(fill)
    if name in ("arctic", "arctic-chain"):
        return Arctic(name == "arctic", fill)
    raise SystemExit(f"unknown source {name!r}: suffix, suffix-chain, lookup, arctic, arctic-chain")


def replay(source, requests: list[dict]) -> dict:
    """Steps, accepted guesses, verified guesses and proposal times over the requests in order;
    per request its accepted guesses per step too."""
    steps = acc = nodes = 0
    times, per_request = [], []
    for req in requests:
        prompt, out = req["prompt_ids"], req["output_ids"]
        source.start(prompt)
        i, r_steps, r_acc = 0, 0, 0
        while i < len(out) - 1:  # out[i] is the pending token
            context = prompt + out[:i + 1]
            t0 = time.perf_counter()
            tokens, parents = source.draft(context)
            times.append(time.perf_counter() - t0)
            a = min(accepted(tokens, parents, out[i + 1:]), len(out) - 1 - i)
            steps, acc, nodes = steps + 1, acc + a, nodes + len(tokens)
            r_steps, r_acc = r_steps + 1, r_acc + a
            i += a + 1
        source.stop(prompt, out)
        per_request.append(r_acc / max(r_steps, 1))
    return {"steps": steps, "accepted_per_step": acc / max(steps, 1), "tokens_per_step": 1 + acc / max(steps, 1),
            "verified_per_step": nodes / max(steps, 1), "propose_us_median": 1e6 * statistics.median(times) if times else 0,
            "propose_us_mean": 1e6 * statistics.fmean(times) if times else 0, "per_request": per_request}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", default="sql,extract,report,tools,samples")
    ap.add_argument("--sources", default="suffix,suffix-chain,lookup,arctic")
    ap.add_argument("--fill", type=int, default=0, help="tokens of stdlib text in the cache first. Default: 0")
    ap.add_argument("--suffix-settings", default="", metavar="K=V,...",
                    help="SuffixParams fields for the suffix sources, e.g. lengths=3,alpha=1.5. Default: its defaults")
    args = ap.parse_args()
    settings = {}
    for item in filter(None, args.suffix_settings.split(",")):
        key, _, value = item.partition("=")
        settings[key] = float(value) if key in ("alpha", "offset", "min_prob") else int(value)
    traces = [t for t in args.traces.split(",") if t]
    sources = [s for s in args.sources.split(",") if s]
    fill = stdlib_fill(args.fill) if args.fill else []
    results: dict = {}
    for name in sources:
        if name.startswith("arctic") and importlib.util.find_spec("arctic_inference") is None:
            print(f"{name}: arctic-inference is not installed; skipped", file=sys.stderr)
            continue
        results[name] = {}
        for trace in traces:
            t0 = time.perf_counter()
            source = make_source(name, fill, settings)
            build = time.perf_counter() - t0
            res = replay(source, load_trace(trace))
            mem, kept = source.memory()
            res.update(build_s=build, cache_bytes=mem, cache_tokens=kept)
            results[name][trace] = res
    print(f"{'source':<13} {'trace':<8} {'acc/step':>8} {'tok/step':>8} {'verified':>8} {'us/step':>8} {'cache MB':>8}")
    for name, per in results.items():
        for trace, r in per.items():
            print(f"{name:<13} {trace:<8} {r['accepted_per_step']:8.2f} {r['tokens_per_step']:8.2f} "
                  f"{r['verified_per_step']:8.2f} {r['propose_us_median']:8.1f} {(r['cache_bytes'] or 0) / 1e6:8.1f}")
    print(json.dumps({"benchmark": "suffix_replay", "fill": args.fill, "suffix_settings": settings,
                      "results": {n: {t: {k: v for k, v in r.items() if k != "per_request"} for t, r in per.items()}
                                  for n, per in results.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
