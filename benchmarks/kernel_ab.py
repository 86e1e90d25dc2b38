"""A/B of the decoding-step kernels against another git revision, in one process.

Builds `specdec/kernels/qlinear.cpp` as it was at --base (under a renamed op namespace, so both
builds load side by side) and times, interleaved, median of --repeats:

  * the kernels' rotation + cache write + attention (`rope_attend`) alone, for T new tokens
    after S cache slots (the default model's shapes: 9 query heads, 3 K/V heads of 64);
  * whole steps of the default model (`--weights` as the loader picks them) with each layer's
    small ops (attention, RMS norm, silu * up) from one build or the other; the matrix products
    are this checkout's in both (a change to them needs forward_costs.py run from two checkouts).

    python benchmarks/kernel_ab.py --base HEAD~1 --threads 2

Only for the CPU kernels (AVX-512); prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _cells(s: str) -> list[tuple[int, int]]:
    try:
        out = [tuple(int(v) for v in c.split("x")) for c in s.split(",") if c.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TxS cells like 1x800,5x805, got {s!r}") from None
    if not out or any(len(c) != 2 or c[0] < 1 or c[1] < c[0] for c in out):
        raise argparse.ArgumentTypeError(f"expected TxS cells with S >= T >= 1, got {s!r}")
    return out


def build_base(rev: str, out: Path):
    """torch.ops.<namespace> of qlinear.cpp at `rev`, built into `out`."""
    from specdec.kernels import _build_flags

    try:
        src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:specdec/kernels/qlinear.cpp"],
                             capture_output=True, text=True, check=True).stdout
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"cannot read specdec/kernels/qlinear.cpp at {rev!r}: {e.stderr.strip()}") from None
    if "TORCH_LIBRARY(specdec_q," not in src:
        raise SystemExit(f"qlinear.cpp at {rev!r} does not define the specdec_q ops")
    src = src.replace("TORCH_LIBRARY(specdec_q,", "TORCH_LIBRARY(specdec_q_base,")
    src = src.replace("TORCH_LIBRARY_IMPL(specdec_q,", "TORCH_LIBRARY_IMPL(specdec_q_base,")
    cpp, lib = out / "base.cpp", out / "base.so"
    cpp.write_text(src)
    res = subprocess.run(["g++", str(cpp), "-o", str(lib), *_build_flags(Path(torch.__file__).resolve().parent)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"building {rev}'s kernels failed: {res.stderr.strip()[-400:]}")
    torch.ops.load_library(str(lib))
    return torch.ops.specdec_q_base


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="HEAD", help="git revision to compare with. Default: HEAD")
    ap.add_argument("--attend", type=_cells, default=_cells("1x200,1x800,1x1500,5x205,5x805,5x1505,9x809"),
                    help="rope_attend cells TxS (T new tokens after S slots). Default: 1x200,...,9x809")
    ap.add_argument("--steps", type=_cells, default=_cells("1x200,5x200,1x800,5x800,1x1500,5x1500"),
                    help="whole-step cells TxS (T new tokens after S tokens of context). Default: 1x200,...,5x1500")
    ap.add_argument("--repeats", type=int, default=21, help="interleaved rounds per cell. Default: 21")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from specdec.models.loader import load_model

    lm = load_model(None, quiet=True)
    from specdec import kernels

    new = kernels.loaded()
    if new is None:
        raise SystemExit(f"the kernels do not run here: {kernels.unavailable()}")
    tmp = tempfile.TemporaryDirectory()
    builds = {"base": build_base(args.base, Path(tmp.name)), "this": new}
    m = lm.model
    cfg = m.cfg
    H, Hkv, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    print(f"base {args.base} vs this checkout; {lm.weights}; threads {args.threads}; median of {args.repeats}")
    report = {"base": args.base, "threads": args.threads, "weights": lm.weights, "attend_us": {}, "step_ms": {}}

    smax = max(s + t for t, s in args.attend + args.steps) + 1
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(1, Hkv, smax, Dh, generator=g), torch.randn(1, Hkv, smax, Dh, generator=g)
    for T, S in args.attend:
        qkv = torch.randn(1, T, (H + 2 * Hkv) * Dh, generator=g)
        cos, sin = torch.randn(1, T, 1, Dh, generator=g), torch.randn(1, T, 1, Dh, generator=g)
        start, mask = torch.tensor([S - T]), (torch.zeros(1, 1, (H // Hkv) * T, S) if T > 1 else None)
        times = {name: [] for name in builds}
        for _ in range(args.repeats):
            for name, ops in builds.items():
                for _ in range(3):
                    ops.rope_attend(qkv, cos, sin, kc, vc, start, H, S, mask)
                t0 = time.perf_counter()
                for _ in range(50):
                    ops.rope_attend(qkv, cos, sin, kc, vc, start, H, S, mask)
                times[name].append((time.perf_counter() - t0) / 50 * 1e6)
        a, b = (statistics.median(times[n]) for n in ("base", "this"))
        report["attend_us"][f"{T}x{S}"] = {"base": round(a, 2), "this": round(b, 2)}
        print(f"rope_attend T={T} S={S}: base {a:.1f} us, this {b:.1f} us ({a / b:.2f}x)")

    ctx = max(s for _, s in args.steps)
    cache = m.new_cache(1, ctx + max(t for t, _ in args.steps) + 1)
    m.forward(torch.randint(0, cfg.vocab_size, (1, ctx), generator=g), torch.arange(ctx)[None], cache,
              logits_at=torch.zeros(1, 0, dtype=torch.long))
    own = [layer.kops for layer in m.layers]
    try:
        for T, S in args.steps:
            times = {name: [] for name in builds}
            for _ in range(args.repeats):
                for name, ops in builds.items():
                    for layer in m.layers:
                        layer.kops = ops
                    ts = []
                    for _ in range(4):
                        cache.lengths.fill_(S)  # the prefill's keys stay in the slots: every call sees S of them
                        tok = torch.randint(0, cfg.vocab_size, (1, T), generator=g)
                        t0 = time.perf_counter()
                        m.forward(tok, torch.arange(S, S + T)[None], cache)
                        ts.append(time.perf_counter() - t0)
                    times[name].append(statistics.median(ts[1:]) * 1e3)
            a, b = (statistics.median(times[n]) for n in ("base", "this"))
            report["step_ms"][f"{T}x{S}"] = {"base": round(a, 3), "this": round(b, 3)}
            print(f"step T={T} after {S}: base {a:.2f} ms, this {b:.2f} ms ({a / b:.3f}x)")
    finally:
        for layer, ops in zip(m.layers, own):
            layer.kops = ops
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
