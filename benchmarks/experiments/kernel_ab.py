"""A/B of the decoding-step kernels against another git revision, in one process.

Builds `specdec/kernels/qlinear.cpp` as it was at --base (under a renamed op namespace, so both
builds load side by side) and times, interleaved, median of --repeats (--sections picks which):

  * attend: the kernels' rotation + cache write + attention (`rope_attend`) alone, for T new
    tokens after S cache slots (the default model's shapes: 9 query heads, 3 K/V heads of 64);
  * steps: whole steps of the default model (`--weights` as the loader picks them) with each
    layer's small ops (attention, RMS norm, silu * up) from one build or the other, the matrix
    products this checkout's in both;
  * products: whole steps of two copies of the default model on the integer kernels, one with
    the base's matrix products *and* its packing of the GGUF's blocks (`models/gguf_blocks.py`
    at --base), the other this checkout's (needs VNNI); also checks their logits are equal;
  * direct: whole steps with the layers' direct kernel calls (`Block.fast`) on and off (this
    checkout only; --base is not used).

    python benchmarks/experiments/kernel_ab.py --base HEAD~1 --threads 2
    python benchmarks/experiments/kernel_ab.py --base HEAD~1 --sections products --steps 1x200,5x200,1x800,5x800

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

ROOT = Path(__file__).resolve().parents[2]


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


def base_products_model(rev: str, lm, base_ops, out: Path):
    """A second copy of the default model whose projections and head compute with the base's
    kernels on blocks packed by the base's models/gguf_blocks.py."""
    import importlib.util

    from specdec.models.loader import load_hf_dir

    try:
        src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:specdec/models/gguf_blocks.py"],
                             capture_output=True, text=True, check=True).stdout
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"cannot read specdec/models/gguf_blocks.py at {rev!r}: {e.stderr.strip()}") from None
    f = out / "gguf_blocks_base.py"
    f.write_text(src)
    spec = importlib.util.spec_from_file_location("gguf_blocks_base", f)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    copy = load_hf_dir(Path(lm.path), quiet=True, with_tokenizer=False).model
    blocks, _ = mod.build_blocks(Path(lm.gguf), Path(lm.path), copy.cfg, "vnni")
    copy.attach_blocks(base_ops, blocks, 16)
    copy.pack()
    return copy


def time_steps(models: dict, setups: dict, cells, repeats: int, vocab: int, g) -> dict:
    """{(T, S): {variant: median ms}} of whole steps of T new tokens after S tokens of context, the
    variants (models, each with its setup run before its turn) interleaved; a model shared by
    variants keeps one cache."""
    ctx, width = max(s for _, s in cells), max(t for t, _ in cells)
    pre = torch.randint(0, vocab, (1, ctx), generator=g)
    caches = {}
    for m in models.values():
        if id(m) not in caches:
            caches[id(m)] = c = m.new_cache(1, ctx + width + 1)
            m.forward(pre, torch.arange(ctx)[None], c, logits_at=torch.zeros(1, 0, dtype=torch.long))
    out = {}
    for T, S in cells:
        times = {n: [] for n in models}
        for _ in range(repeats):
            for n, m in models.items():
                if setups.get(n):
                    setups[n]()
                c, ts = caches[id(m)], []
                for _ in range(4):
                    c.lengths.fill_(S)  # the prefill's keys stay in the slots: every call sees S of them
                    tok = torch.randint(0, vocab, (1, T), generator=g)
                    t0 = time.perf_counter()
                    m.forward(tok, torch.arange(S, S + T)[None], c)
                    ts.append(time.perf_counter() - t0)
                times[n].append(statistics.median(ts[1:]) * 1e3)
        out[(T, S)] = {n: statistics.median(v) for n, v in times.items()}
    return out


def _report(res: dict, what: str) -> dict:
    out = {}
    for (T, S), v in res.items():
        a, b = v["base"], v["this"]
        out[f"{T}x{S}"] = {"base": round(a, 3), "this": round(b, 3)}
        print(f"{what}: T={T} after {S}: base {a:.2f} ms, this {b:.2f} ms ({a / b:.3f}x)")
    return out


def _logits(m, vocab: int) -> torch.Tensor:
    """Logits of a fixed prefill and two steps (a chain of 3, then 1) on a fresh cache."""
    g = torch.Generator().manual_seed(1)
    c = m.new_cache(1, 320)
    m.forward(torch.randint(0, vocab, (1, 300), generator=g), torch.arange(300)[None], c)
    a = m.forward(torch.tensor([[5, 6, 7]]), torch.arange(300, 303)[None], c)[0]
    return torch.cat([a, m.forward(torch.tensor([[9]]), torch.tensor([[303]]), c)[0]], 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="HEAD", help="git revision to compare with. Default: HEAD")
    ap.add_argument("--attend", type=_cells, default=_cells("1x200,1x800,1x1500,5x205,5x805,5x1505,9x809"),
                    help="rope_attend cells TxS (T new tokens after S slots). Default: 1x200,...,9x809")
    ap.add_argument("--steps", type=_cells, default=_cells("1x200,5x200,1x800,5x800,1x1500,5x1500"),
                    help="whole-step cells TxS (T new tokens after S tokens of context). Default: 1x200,...,5x1500")
    ap.add_argument("--repeats", type=int, default=21, help="interleaved rounds per cell. Default: 21")
    ap.add_argument("--sections", default="attend,steps",
                    help="comma-separated: attend, steps, products, direct (see above). Default: attend,steps")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    sections = [x.strip() for x in args.sections.split(",") if x.strip()]
    bad = [x for x in sections if x not in ("attend", "steps", "products", "direct")]
    if bad or not sections:
        raise SystemExit(f"--sections takes attend, steps, products and/or direct, got {args.sections!r}")
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
    report = {"base": args.base, "threads": args.threads, "weights": lm.weights, "attend_us": {}}

    smax = max(s + t for t, s in args.attend + args.steps) + 1
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(1, Hkv, smax, Dh, generator=g), torch.randn(1, Hkv, smax, Dh, generator=g)
    for T, S in args.attend if "attend" in sections else []:
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

    if "products" in sections:
        if "int16" not in lm.weights:
            raise SystemExit(f"--sections products needs the integer kernels (VNNI); this model runs {lm.weights}")
        base_model = base_products_model(args.base, lm, builds["base"], Path(tmp.name))
        models = {"base": base_model, "this": m}
        report["products_ms"] = _report(time_steps(models, {}, args.steps, args.repeats, cfg.vocab_size, g),
                                        "steps, base products + packing")
        same = [_logits(x, cfg.vocab_size) for x in models.values()]
        report["products_logits_equal"] = bool(torch.equal(*same))
        print(f"logits of base and this products equal: {report['products_logits_equal']}")
    if "steps" in sections:
        own = [layer.kops for layer in m.layers]

        def small_ops(ops):
            return lambda: [setattr(layer, "kops", ops) for layer in m.layers]

        try:
            report["step_ms"] = _report(time_steps({"base": m, "this": m}, {n: small_ops(o) for n, o in builds.items()},
                                                   args.steps, args.repeats, cfg.vocab_size, g), "steps, base small ops")
        finally:
            for layer, ops in zip(m.layers, own):
                layer.kops = ops
    if "direct" in sections:
        fast = [layer.fast for layer in m.layers]
        if all(f is None for f in fast):
            raise SystemExit("--sections direct: this model's layers have no direct kernel calls (Block.fast)")

        def direct(on):
            return lambda: [setattr(layer, "fast", f if on else None) for layer, f in zip(m.layers, fast)]

        try:
            res = time_steps({"base": m, "this": m}, {"base": direct(False), "this": direct(True)}, args.steps,
                             args.repeats, cfg.vocab_size, g)
            report["direct_ms"] = _report(res, "steps, direct calls off (base) / on (this)")
        finally:
            direct(True)()
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
