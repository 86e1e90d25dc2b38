"""Speed of the row-stable GGUF kernels (torch.ops.specdec_rs.gguf_linear) on random blocks.

Six parts, each timing its variants interleaved (one call of each in turn, repeated) and
printing medians:
- `bandwidth`: the machine's memory bandwidth, as a large torch copy (bytes read + written) and a
  large sum (bytes read), to compare the kernels' GB/s with;
- `raw`: gguf_linear_q8 (or `--op gguf_linear`, the float path) over the Qwen2.5 1.5B matrix shapes (1536x1536, 8960x1536, 1536x8960,
  151936x1536) for each type and row count M: ms a call and GB/s of weight bytes read;
- `repack`: gguf_linear on the file's own Q4_1 / Q8_0 bytes against q4_1_linear / q8_0_linear on
  the repacked K-major copy (models/gguf_blocks.py), on the default model's shapes (SmolLM2-135M:
  576x576, 960x576 fused qkv, 3072x576 fused gate/up, 576x1536, 49152x576 head), M = 1..6;
- `drafter`: a drafter's Q8_0 copies of its float weights (gguf_blocks.quantize_q8_0) on the float
  path (q8_0_linear) against the 8-bit-activation path (q8_0_linear_q8, kernel_glue.drafting_act8),
  on the default model's EAGLE head shapes (the 8192-row subset head, fc 576x1152, fused qkv, o,
  gate/up, down), M = 1, 4, 8;
- `ab`: gguf_linear_q8 (`--op kq_linear_q8`: kq_linear_q8 over this tree's repacking, the two
  checked equal bit for bit) of this tree's kernels against those of git revision `--base` (its
  rowstable.cpp built beside them under another op namespace, in the same process), interleaved,
  on weights read cold from memory (copies rotated past the caches' size; `--hot`: one copy, from
  the caches; on one thread CPU time, as `verify`); checks the two agree;
- `attend`: the row-stable attention of this tree against `--base`'s on the 1.5B's shapes (T =
  `--m` new tokens after 200 slots, 28 layers a timing), interleaved, checked equal bit for bit;
- `verify`: one forward of the real 1.5B target (benchmarks/qwen_pair.py's Q4_K_M file, 8-bit
  activations) over T = 1, 2, 4, 8, 16 new tokens after a 100-token context (a verification step),
  its GGUF projections and other row-stable kernels (norms, attention) switched between this
  tree's and those of `--base` (as in `ab`; the Python is this tree's) in the same loaded model,
  interleaved: ms and each T's cost over T = 1, medians (and the ratio of the best times); on one
  thread the CPU time of the step, which another process's preemption does not stretch.

    python3 benchmarks/gguf_kernels.py bandwidth raw repack --threads 2
    python3 benchmarks/gguf_kernels.py drafter --threads 1
    python3 benchmarks/gguf_kernels.py raw --types Q4_K,Q6_K --m 1,4 --shapes 1536x1536,8960x1536
    python3 benchmarks/gguf_kernels.py bandwidth raw --threads 1 --types Q4_K,Q8_0 --m 1 --shapes 151936x1536,16384x8960
    python3 benchmarks/gguf_kernels.py ab --base main --threads 1 --types Q4_K,Q6_K --m 1,2,4
    python3 benchmarks/gguf_kernels.py ab --base main --base-isa avx512vnni --threads 1 --types Q4_K,Q6_K --m 1 --hot
    python3 benchmarks/gguf_kernels.py ab --op kq_linear_q8 --base main --base-isa avx512vnni --threads 1 \
        --types Q4_K,Q6_K --m 1,8,12,16 --shapes 17920x1536,1536x8960 --hot
    python3 benchmarks/gguf_kernels.py ab --op kq_linear_q8 --base file-blocks --threads 1 --types Q4_K,Q5_K,Q6_K \
        --m 1,8,16 --shapes 17920x1536,1536x8960
    python3 benchmarks/gguf_kernels.py attend --base main --base-isa avx512vnni --threads 1 --m 1,4,8,16 --reps 41
    python3 benchmarks/gguf_kernels.py verify --base main --threads 1 --reps 9

(the last: matrices far larger than the caches, read from memory, against the bandwidth figures)
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from gguf_random import random_blocks  # noqa: E402

from specdec import kernels  # noqa: E402
from specdec.models.loader import cache_root  # noqa: E402

QWEN_SHAPES = "1536x1536,8960x1536,1536x8960,151936x1536"
SMOL_SHAPES = "576x576,960x576,3072x576,576x1536,49152x576"


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def interleaved(variants: dict, reps: int, budget_s: float, clock=time.perf_counter) -> dict[str, tuple[float, float]]:
    """(median, minimum) seconds a call of each variant, calling them in turn `reps` times (at least
    3; fewer once budget_s has passed), after one warm-up call each. The minimum is shown beside the
    median because other processes on a shared machine stretch single calls."""
    for f in variants.values():
        f()
    times: dict[str, list[float]] = {k: [] for k in variants}
    t_start = time.perf_counter()
    for r in range(reps):
        for k, f in variants.items():
            t0 = clock()
            f()
            times[k].append(clock() - t0)
        if r >= 2 and time.perf_counter() - t_start > budget_s:
            break
    return {k: (statistics.median(v), min(v)) for k, v in times.items()}


def one_thread_clock():
    """The clock of the A/B comparisons: on one thread the calling thread's CPU time (a shared
    machine's other processes preempt a call, which wall time counts); on several, wall time."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def bandwidth(reps: int) -> None:
    a = torch.empty(2**28 // 4 * 4, dtype=torch.float32).fill_(1.0)  # 1 GiB
    b = torch.empty_like(a)
    t = interleaved({"copy": lambda: b.copy_(a), "sum": lambda: a.sum()}, reps, 60)
    gb = a.numel() * 4 / 1e9
    print(f"memory, median (best): copy {2 * gb / t['copy'][0]:.1f} ({2 * gb / t['copy'][1]:.1f}) GB/s (read + write), "
          f"sum {gb / t['sum'][0]:.1f} ({gb / t['sum'][1]:.1f}) GB/s (read) over {gb:.2f} GB, {torch.get_num_threads()} threads")


def raw_table(ops, types: list[str], shapes: list[tuple[int, int]], ms: list[int], reps: int, op: str) -> None:
    rng = np.random.default_rng(0)
    linear = getattr(ops, op)
    print("| type | N x K | MB | " + " | ".join(f"M={m}: median ms (GB/s), best ms (GB/s)" for m in ms) + " |")
    print("|---|---|---|" + "---|" * len(ms))
    for n, k in shapes:
        mats = {}
        for name in types:
            t = kernels.GGUF_TYPES[name].id
            mats[name] = (t, torch.from_numpy(random_blocks(t, n, k, rng).reshape(-1)))
        for name, (t, raw) in mats.items():
            cells = []
            for m in ms:
                x = torch.randn(m, k)
                med, best = interleaved({name: lambda: linear(x, raw, t, n, k)}, reps, 20)[name]
                cells.append(f"{med * 1e3:.3f} ({raw.numel() / med / 1e9:.1f}), best {best * 1e3:.3f} "
                             f"({raw.numel() / best / 1e9:.1f})")
            print(f"| {name} | {n}x{k} | {raw.numel() / 1e6:.1f} | " + " | ".join(cells) + " |", flush=True)


def repack_table(ops, shapes: list[tuple[int, int]], ms: list[int], reps: int) -> None:
    from specdec.models import gguf_blocks as gb

    rng = np.random.default_rng(1)
    print("| type | N x K | M | raw ms | repacked ms | raw / repacked | best: raw / repacked |")
    print("|---|---|---|---|---|---|---|")
    for name, pack, op in (("Q4_1", lambda r: gb._pack_q4(*gb._q4(r, "Q4_1")), ops.q4_1_linear),
                           ("Q8_0", lambda r: gb._pack_q8(*gb._q8(r)), ops.q8_0_linear)):
        t = kernels.GGUF_TYPES[name].id
        for n, k in shapes:
            raw_np = random_blocks(t, n, k, rng)
            raw, packed = torch.from_numpy(raw_np.reshape(-1)), pack(raw_np)
            for m in ms:
                x = torch.randn(m, k)
                assert torch.equal(ops.gguf_linear(x, raw, t, n, k), op(x, packed, n))
                med = interleaved({"raw": lambda: ops.gguf_linear(x, raw, t, n, k),
                                   "packed": lambda: op(x, packed, n)}, reps, 20)
                (r, r_best), (p, p_best) = med["raw"], med["packed"]
                print(f"| {name} | {n}x{k} | {m} | {r * 1e3:.3f} | {p * 1e3:.3f} | {r / p:.2f} | {r_best / p_best:.2f} |",
                      flush=True)


DRAFTER_SHAPES = "8192x576,576x1152,960x576,576x576,3072x576,576x1536"  # the default model's EAGLE head


def drafter_table(ops, shapes: list[tuple[int, int]], ms: list[int], reps: int) -> None:
    from specdec.models import gguf_blocks as gb

    print("| N x K | M | float path ms | 8-bit activations ms | float / 8-bit | best: float / 8-bit |")
    print("|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(1)
    for n, k in shapes:
        w = torch.randn(n, k, generator=g) * 0.05
        (_, kmajor, _), (_, i8, _) = gb.quantize_q8_0(w), gb.quantize_q8_0(w, act8=True)
        for m in ms:
            x = torch.randn(m, k, generator=g)
            med = interleaved({"float": lambda: ops.q8_0_linear(x, kmajor, n),
                               "act8": lambda: ops.q8_0_linear_q8(x, i8, n)}, reps, 20, one_thread_clock())
            (f, f_best), (q, q_best) = med["float"], med["act8"]
            print(f"| {n}x{k} | {m} | {f * 1e3:.3f} | {q * 1e3:.3f} | {f / q:.2f} | {f_best / q_best:.2f} |", flush=True)


def base_ops(rev: str, isa: str = "avx2"):
    """The row-stable kernels of git revision `rev` (its rowstable.cpp, in the build `isa` of
    kernels.ROWSTABLE_ISA: the AVX2 one by default, so that `--base HEAD` compares this tree's AVX-512
    VNNI build with its AVX2 one), loaded as torch.ops.specdec_rs_base."""
    import subprocess
    import tempfile

    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:specdec/kernels/rowstable.cpp"], check=True,
                         capture_output=True, text=True).stdout
    for macro in ("TORCH_LIBRARY", "TORCH_LIBRARY_FRAGMENT", "TORCH_LIBRARY_IMPL"):
        src = src.replace(f"{macro}(specdec_rs,", f"{macro}(specdec_rs_base,")
    path = Path(tempfile.mkdtemp()) / "rowstable_base.cpp"
    path.write_text(src)
    torch.ops.load_library(str(kernels._build(cache_root() / "kernels", True, path, kernels.ROWSTABLE_ISA[isa])))
    return torch.ops.specdec_rs_base


def use_kernels(model, ns, file_blocks: bool = False) -> None:
    """Point every GGUF projection of `model` at gguf_linear_q8 / gguf_linear_cat_q8 of op namespace
    `ns` (this tree's torch.ops.specdec_rs or base_ops()), and the step's other row-stable kernels
    (norms, attention, SiLU: each layer's kops) at ns's too; the Python stays this tree's.
    Matrices repacked for an op of their own (K-quants for kq_linear_q8, Q4_1 / Q8_0 for
    q4_1_linear_q8 / q8_0_linear_q8) stay repacked (this tree's layout) on `ns`'s op of that name
    where it has one, unless file_blocks; else they go back to the file's blocks. (A revision whose
    kq_linear_q8 lacks a type this tree repacks, Q5_K before it was added, refuses it: file_blocks.
    Sending the default model's repacked Q4_1 / Q8_0 back to the file's blocks had made `--base`
    read ~10% slower than this tree on the same code.)"""
    from specdec.models.gguf_model import GGUFLinear

    for lin in model.modules():
        if isinstance(lin, GGUFLinear):
            if lin.rs_blocks is not None:
                name = getattr(lin.rs_blocks[0], "__name__", "")
                if name and hasattr(ns, name) and not file_blocks:
                    lin.rs_blocks = (getattr(ns, name), *lin.rs_blocks[1:])
                    continue
                lin.rs_blocks, lin.rs_every_call = None, False  # (repacked: back on the file's blocks)
            lin.op = ns.gguf_linear_q8
            if lin.op_cat is not None:
                lin.op_cat = ns.gguf_linear_cat_q8
    for blk in getattr(model, "layers", []):  # the direct decoding-step calls hold the kernels too
        if blk.kops is not None:
            blk.kops = ns
        if blk.fast is not None:
            blk.fast = blk.fast_step_args()


def ab_table(ops, base, rev: str, types: list[str], shapes: list[tuple[int, int]], ms: list[int], reps: int,
             hot: bool = False, op: str = "gguf_linear_q8") -> None:
    """base None (op kq_linear_q8 only): against this tree's gguf_linear_q8 on the file's own blocks
    (what a projection of that type runs on where it is not repacked), the numbers close, not equal."""
    rng = np.random.default_rng(2)
    print(f"| type | N x K | M | {rev} ms (GB/s) | this tree ms (GB/s) | {rev} / this, median | best |")
    print("|---|---|---|---|---|---|---|")
    for n, k in shapes:
        for name in types:
            t = kernels.GGUF_TYPES[name].id
            file_bytes = random_blocks(t, n, k, rng).reshape(-1)
            one = file_bytes
            if op == "kq_linear_q8":  # this tree's repacking (models/gguf_blocks.pack_k_i8) for both kernels
                from specdec.models import gguf_blocks

                one = gguf_blocks.pack_k_i8(file_bytes.reshape(n, -1), t).numpy()
            copies = 1 if hot else max(1, int(96e6 // one.size) + 1)  # hot: one copy, in cache; else > L3
            raws = [torch.from_numpy(one.copy()) for _ in range(copies)]
            files = [torch.from_numpy(file_bytes.copy()) for _ in range(copies)] if base is None else raws

            def product(ns, x, i):
                if ns is None:  # (the file's blocks)
                    return ops.gguf_linear_q8(x, files[i], t, n, k)
                if op == "kq_linear_q8":
                    return ns.kq_linear_q8(x, [raws[i]], [t], [n], k)
                return ns.gguf_linear_q8(x, raws[i], t, n, k)

            for m in ms:
                x = torch.randn(m, k)
                a, b = product(ops, x, 0), product(base, x, 0)
                if op == "kq_linear_q8" and base is not None:  # (one set of numbers: a change to its tiles keeps them)
                    assert torch.equal(a, b), (name, m)
                assert torch.allclose(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max())), (name, m)
                turn = iter(range(10**9))

                def call(ns):
                    return lambda: product(ns, x, next(turn) % len(raws))

                res = interleaved({"base": call(base), "this": call(ops)}, reps, 30, one_thread_clock())
                (bm, bb), (tm, tb) = res["base"], res["this"]
                base_bytes = file_bytes.size if base is None else one.size
                print(f"| {name} | {n}x{k} | {m} | {bm * 1e3:.3f} ({base_bytes / bm / 1e9:.1f}) | {tm * 1e3:.3f} "
                      f"({one.size / tm / 1e9:.1f}) | {bm / tm:.2f} | {bb / tb:.2f} |", flush=True)


def attend_table(ops, base, rev: str, Ts: list[int], reps: int) -> None:
    """The row-stable attention (`attend`) of this tree against revision rev's on the Qwen2.5 1.5B's
    shapes (12 query heads on 2 K/V heads of 128, T new tokens after 200 slots, no mask), 28 calls
    (its layers) a timing, interleaved; checks the two equal bit for bit."""
    g = torch.Generator().manual_seed(0)
    print(f"| T | {rev} ms (28 layers) | this tree ms | {rev} / this, median | best |")
    print("|---|---|---|---|---|")
    for T in Ts:
        S = 200 + T
        q = torch.randn(1, 12, T, 128, generator=g)
        kc, vc = torch.randn(1, 2, S + 64, 128, generator=g), torch.randn(1, 2, S + 64, 128, generator=g)
        assert torch.equal(ops.attend(q, kc, vc, S, None), base.attend(q, kc, vc, S, None)), T

        def call(ns):
            return lambda: [ns.attend(q, kc, vc, S, None) for _ in range(28)]

        res = interleaved({"base": call(base), "this": call(ops)}, reps, 30, one_thread_clock())
        (bm, bb), (tm, tb) = res["base"], res["this"]
        print(f"| {T} | {bm * 1e3:.2f} | {tm * 1e3:.2f} | {bm / tm:.2f} | {bb / tb:.2f} |", flush=True)


def verify_table(ops, base, rev: str, reps: int) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from qwen_pair import fetch, load_target
    from specdec.models.gguf_model import GGUFLinear

    if not fetch("target").is_file():
        sys.exit("verify: the 1.5B file is not here; run `python3 benchmarks/qwen_pair.py fetch` first")
    m = load_target(True).model
    lins = [mod for mod in m.modules() if isinstance(mod, GGUFLinear)]
    if not all(lin.op is ops.gguf_linear_q8 for lin in lins):
        sys.exit("verify: the model's projections are not on this tree's gguf_linear_q8 (SPECDEC_GGUF_ACT8=0?)")

    clock = one_thread_clock()
    P, Ts = 100, (1, 2, 4, 8, 16)
    ctx = torch.randint(1000, 20000, (1, P + max(Ts)), generator=torch.Generator().manual_seed(0))
    cache = m.new_cache(1, 512)
    times = {(k, T): [] for k in ("base", "this") for T in Ts}
    with torch.inference_mode():
        m(ctx[:, :P], torch.arange(P)[None], cache)
        for _ in range(reps):
            for T in Ts:
                for k, ns in (("base", base), ("this", ops)):
                    use_kernels(m, ns)
                    cache.truncate(torch.tensor([P]))
                    t0 = clock()
                    m(ctx[:, P:P + T], torch.arange(P, P + T)[None], cache)
                    times[(k, T)].append(clock() - t0)
    use_kernels(m, ops)
    med = {key: statistics.median(v) for key, v in times.items()}
    best = {key: min(v) for key, v in times.items()}
    print(f"({'CPU' if clock is time.thread_time else 'wall'} time)")
    print(f"| T | {rev} ms (x T=1) | this tree ms (x T=1) | {rev} / this, median | best |")
    print("|---|---|---|---|---|")
    for T in Ts:
        b, t = med[("base", T)], med[("this", T)]
        print(f"| {T} | {b * 1e3:.1f} ({b / med[('base', 1)]:.2f}) | {t * 1e3:.1f} ({t / med[('this', 1)]:.2f}) | {b / t:.2f} "
              f"| {best[('base', T)] / best[('this', T)]:.2f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("parts", nargs="+", choices=["bandwidth", "raw", "repack", "drafter", "ab", "attend", "verify"])
    ap.add_argument("--base", default="main", help="ab, verify: the git revision to compare against (ab --op "
                    "kq_linear_q8 --base file-blocks: this tree's gguf_linear_q8 on the file's own blocks)")
    ap.add_argument("--base-isa", default="avx2", choices=sorted(kernels.ROWSTABLE_ISA),
                    help="ab, verify: the build of --base's kernels (avx512vnni: the same build as this tree's on a VNNI CPU)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--hot", action="store_true", help="ab: one copy of each matrix, read from the caches (the kernels' instruction cost)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--types", default="Q4_K,Q5_K,Q6_K,Q8_0,Q4_0,F16")
    ap.add_argument("--shapes", default=None, help=f"NxK,... (raw: {QWEN_SHAPES}; repack: {SMOL_SHAPES})")
    ap.add_argument("--m", default=None, help="row counts (raw: 1,4,64,256; repack: 1,2,3,4,5,6)")
    ap.add_argument("--op", default="gguf_linear_q8", choices=["gguf_linear_q8", "gguf_linear", "kq_linear_q8"],
                    help="raw: the 8-bit-activation path (the default) or the float path; ab: gguf_linear_q8 "
                         "over the file's blocks or kq_linear_q8 over this tree's repacking (Q4_K, Q5_K, Q6_K)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    ops = kernels.rowstable_ops(cache_root() / "kernels", quiet=False)
    if ops is None:
        sys.exit(f"the row-stable kernels cannot run here: {kernels.rowstable_unavailable()}")
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"this tree's {kernels.rowstable_isa()} build")

    def parse_shapes(default: str) -> list[tuple[int, int]]:
        return [tuple(int(v) for v in s.split("x")) for s in (a.shapes or default).split(",")]

    for part in a.parts:
        if part == "bandwidth":
            bandwidth(a.reps)
        elif part == "ab":
            file_blocks = a.op == "kq_linear_q8" and a.base == "file-blocks"
            ab_table(ops, None if file_blocks else base_ops(a.base, a.base_isa), a.base, a.types.split(","),
                     parse_shapes(QWEN_SHAPES), [int(v) for v in (a.m or "1,2,4,8").split(",")], a.reps, a.hot, a.op)
        elif part == "attend":
            attend_table(ops, base_ops(a.base, a.base_isa), a.base, [int(v) for v in (a.m or "1,4,8,16").split(",")], a.reps)
        elif part == "verify":
            verify_table(ops, base_ops(a.base, a.base_isa), a.base, a.reps)
        elif part == "drafter":
            drafter_table(ops, parse_shapes(DRAFTER_SHAPES), [int(v) for v in (a.m or "1,4,8").split(",")], a.reps)
        elif part == "raw":
            raw_table(ops, a.types.split(","), parse_shapes(QWEN_SHAPES),
                      [int(v) for v in (a.m or "1,4,64,256").split(",")], a.reps, a.op)
        else:
            repack_table(ops, parse_shapes(SMOL_SHAPES), [int(v) for v in (a.m or "1,2,3,4,5,6").split(",")], a.reps)


if __name__ == "__main__":
    main()
