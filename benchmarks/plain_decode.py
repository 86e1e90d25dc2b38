"""Plain (non-speculative) decode speed: specdec vs transformers `generate`, same run.

Same weights, same prompts (first turns of Spec-Bench dev, chat template), greedy, EOS ignored
so every run makes exactly --max-new-tokens tokens, same thread count. The peer is transformers
`generate` in fp32 on the same weights: for a GGUF target (the default model, or --model
FILE.gguf) transformers' own GGUF loading, which dequantises every tensor to an fp32 copy
(specdec computes from the file's blocks), for a model folder the folder itself; `--peer none`
skips it (a large GGUF's fp32 copy takes ~4 bytes a weight and minutes to build). The two engines
are interleaved per repeat so machine drift hits both alike; the median over repeats is reported. Also
measures memory bandwidth (a large tensor reduction) to give the batch-1 limit

    tokens/s <= bandwidth / (bytes of weights read per token)

and how close each engine gets. Prints a table, then one JSON document as the last line.

    python benchmarks/plain_decode.py --prompts 4 --max-new-tokens 64 --repeats 3
    python benchmarks/plain_decode.py --model FILE.gguf --peer none
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from devset import DEV_SET

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = DEV_SET


def measure_bandwidth(mb: int = 1024, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s: median time of summing a large fp32 tensor."""
    x = torch.ones(mb * 1024 * 1024 // 4, dtype=torch.float32)
    x.sum()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        ts.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(ts)


def load_prompts(path: Path, n: int) -> list[str]:
    out = []
    with open(path) as f:
        for line in f:
            obj = json.loads(line)
            out.append(obj["turns"][0])
    # spread over categories: take every len/n-th prompt
    step = max(1, len(out) // n)
    return out[::step][:n]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="target (default: embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--data", default=str(DEFAULT_DATA), help="Spec-Bench style JSONL")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--peer", choices=("transformers", "none"), default="transformers",
                    help="transformers: its fp32 generate on the same weights (a GGUF dequantised by transformers' "
                         "GGUF loading); none: specdec alone")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from specdec.bench.peers import _hf_model
    from specdec.engine import Engine
    from specdec.models.loader import load_model
    from specdec.text import encode_prompt
    from specdec.types import SamplingParams

    lm = load_model(args.model, quiet=True)
    peer = None
    if args.peer == "transformers":
        peer = ("transformers generate, fp32 dequantised from the same GGUF by transformers" if lm.gguf
                else "transformers generate, fp32, the same folder")
        hf = _hf_model(lm.path)  # (a GGUF file: transformers' own GGUF loading)
        hf.generation_config.eos_token_id = None
    print(f"peer: {peer or 'none (--peer none)'}", file=sys.stderr)
    prompts = [encode_prompt(lm.tokenizer, p, None) for p in load_prompts(Path(args.data), args.prompts)]
    N = args.max_new_tokens
    engine = Engine(lm.model, eos_ids=())  # EOS ignored: both engines make exactly N tokens
    params = SamplingParams(max_new_tokens=N)

    def run_specdec(ids):
        t = time.perf_counter()
        r = engine.generate([ids], params)[0]
        return time.perf_counter() - t, r.tokens, r.stats.decode_s

    @torch.inference_mode()
    def run_hf(ids):
        x = torch.tensor([ids])
        t = time.perf_counter()
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=N, min_new_tokens=N, do_sample=False)
        return time.perf_counter() - t, out[0, len(ids):].tolist(), None

    run_specdec(prompts[0])  # warm-up both
    if peer:
        run_hf(prompts[0])
    rates = {"specdec": [], "transformers": []} if peer else {"specdec": []}
    decode_rates = []
    agree = 0
    for rep in range(args.repeats):
        tot = dict.fromkeys(rates, 0.0)
        dec = 0.0
        for ids in prompts:
            ts, toks_s, d = run_specdec(ids)
            tot["specdec"] += ts
            dec += d
            if peer:
                th, toks_h, _ = run_hf(ids)
                tot["transformers"] += th
                if rep == 0:
                    agree += toks_s == toks_h
        n_tok = N * len(prompts)
        for k in rates:
            rates[k].append(n_tok / tot[k])
        decode_rates.append((N - 1) * len(prompts) / dec)
        print(f"repeat {rep + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1]:.1f} tok/s" for k, v in rates.items()),
              file=sys.stderr)

    bw = measure_bandwidth()
    wbytes = lm.model.weight_bytes_per_token()
    limit = bw / wbytes
    med = {k: statistics.median(v) for k, v in rates.items()}
    med_decode = statistics.median(decode_rates)
    result = {
        "benchmark": "plain_decode",
        "model": lm.name,
        "threads": args.threads,
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "prompts": len(prompts),
        "max_new_tokens": N,
        "repeats": args.repeats,
        "specdec_tok_s": round(med["specdec"], 2),
        "specdec_decode_only_tok_s": round(med_decode, 2),
        "weights": lm.weights,
        "peer": peer,
        "transformers_tok_s": round(med["transformers"], 2) if peer else None,
        "ratio_specdec_over_transformers": round(med["specdec"] / med["transformers"], 3) if peer else None,
        "bandwidth_gb_s": round(bw / 1e9, 2),
        "weight_bytes_per_token": wbytes,
        "bandwidth_limit_tok_s": round(limit, 2),
        "limit_over_specdec_decode": round(limit / med_decode, 3),
        "greedy_outputs_equal": f"{agree}/{len(prompts)}" if peer else None,
    }
    print()
    print(f"{'engine':<28}{'tok/s (median)':>16}")
    print(f"{'specdec none (end to end)':<28}{med['specdec']:>16.2f}")
    print(f"{'specdec none (decode only)':<28}{med_decode:>16.2f}")
    if peer:
        print(f"{'transformers generate':<28}{med['transformers']:>16.2f}   ({peer})")
    print(f"{'bandwidth limit':<28}{limit:>16.2f}   ({bw / 1e9:.1f} GB/s / {wbytes / 1e6:.0f} MB per token)")
    if peer:
        print(f"ratio specdec / transformers: {result['ratio_specdec_over_transformers']:.2f}x; "
              f"greedy outputs equal: {result['greedy_outputs_equal']}; ", end="")
    print(f"limit / specdec decode: {result['limit_over_specdec_decode']:.2f}x; threads {args.threads}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
