"""The AVX-512 VNNI build of rowstable.cpp gives the AVX2 build's numbers bit for bit.

On a CPU with AVX-512 VNNI, VL and BW, kernels.rowstable_ops() loads rowstable.cpp compiled with
those flags too, whose 8-bit-activation integer dot products run on _mm256_dpbusd_epi32 in another
lane layout than the AVX2 build's _mm256_maddubs_epi16 + _mm256_madd_epi16. Integer sums are exact
and each build's int32 lanes hold the same integers, so every output must be equal. Oracle: the AVX2
build itself (SPECDEC_ROWSTABLE=avx2), run in a subprocess on the same inputs: random blocks of every
type, blocks whose quants are all at their largest magnitude (the AVX2 build's int16 sums at their
limits) by activations that round to +-127, every tile size of the integer paths (1-9, 16, 17, 33
rows), gguf_linear_q8 and the repacked blocks' q4_1_linear_q8 / q8_0_linear_q8 / kq_linear_q8. The float path and
attention, compiled under the wider flags too, are compared as well.
Skipped on CPUs without VNNI (only the AVX2 build runs there; the other tests cover it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from model_helpers import need_kernels
from gguf_random import F16, NAMES, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, act8_rows, random_blocks
from specdec import kernels

ROOT = Path(__file__).resolve().parents[2]
INT_TYPES = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)
ROWS = (*range(1, 10), 14, 16, 17, 33)

# the bytes of a block's quants, and the byte that puts each at its largest magnitude (Q8_0: -128)
EXTREME = {Q4_0: ([(2, 18)], 0xFF), Q4_1: ([(4, 20)], 0xFF), Q5_0: ([(2, 22)], 0xFF), Q5_1: ([(4, 24)], 0xFF),
           Q8_0: ([(2, 34)], 0x80), Q4_K: ([(16, 144)], 0xFF), Q5_K: ([(16, 176)], 0xFF), Q6_K: ([(0, 192)], 0xFF)}

# run in the subprocess: the same calls on the AVX2 build
CHILD = """
import sys, torch
from specdec import kernels
from specdec.models.loader import cache_root
ops = kernels.rowstable_ops(cache_root() / "kernels")
assert ops is not None, kernels.rowstable_unavailable()
cases = torch.load(sys.argv[1])
out = {"int_dot": ops.int_dot()}
for key, (op, args) in cases.items():
    out[key] = getattr(ops, op)(*args)
torch.save(out, sys.argv[2])
"""


def extreme_blocks(t: int, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    raw = random_blocks(t, n, k, rng).reshape(n * k // kernels.GGUF_TYPES[NAMES[t]].block_size, -1).copy()
    spans, byte = EXTREME[t]
    for a, b in spans:
        raw[:, a:b] = byte
    return raw.reshape(-1)


def cases() -> dict:
    """name -> (op, args): the calls both builds make."""
    g = torch.Generator().manual_seed(5)
    rng = np.random.default_rng(5)
    out = {}
    for t in INT_TYPES:
        for kind in ("random", "extreme"):
            for n, k in [(7, 256), (29, 768)]:
                blocks = random_blocks(t, n, k, rng).reshape(-1) if kind == "random" else extreme_blocks(t, n, k, rng)
                raw = torch.from_numpy(blocks)
                for m in ROWS:
                    x = act8_rows(m, k, g)
                    out[f"q8 {NAMES[t]} {kind} {n}x{k} M={m}"] = ("gguf_linear_q8", (x, raw, t, n, k))
                    if m in (1, 4, 9):
                        out[f"float {NAMES[t]} {kind} {n}x{k} M={m}"] = ("gguf_linear", (x, raw, t, n, k))
    # the 32-weight block types repacked in groups of 16 outputs (q4_1_linear_q8, q8_0_linear_q8)
    from specdec.models import gguf_blocks as gb

    for t in (Q4_0, Q4_1, Q8_0):
        for kind in ("random", "extreme"):
            n, k = 32, 96
            raw = (random_blocks(t, n, k, rng) if kind == "random" else extreme_blocks(t, n, k, rng)).reshape(n, -1)
            op, packed = ("q8_0_linear_q8", gb.pack_q8_i8(*gb._q8(raw))) if t == Q8_0 else \
                ("q4_1_linear_q8", gb.pack_q4_i8(*gb._q4(raw, NAMES[t])))
            for m in ROWS:
                out[f"i8 {NAMES[t]} {kind} M={m}"] = (op, (act8_rows(m, k, g), packed, n))
    # the K-quants repacked in groups of 16 outputs (kq_linear_q8), mixed parts in one call too
    for t in (Q4_K, Q5_K, Q6_K):
        for kind in ("random", "extreme"):
            n, k = 32, 512
            raw = (random_blocks(t, n, k, rng) if kind == "random" else extreme_blocks(t, n, k, rng)).reshape(n, -1)
            packed = gb.pack_k_i8(raw, t)
            for m in ROWS:
                out[f"kq {NAMES[t]} {kind} M={m}"] = ("kq_linear_q8", (act8_rows(m, k, g), [packed], [t], [n], k))
    kq_parts = [gb.pack_k_i8(random_blocks(t, 16, 256, rng).reshape(16, -1), t) for t in (Q4_K, Q5_K, Q6_K)]
    out["kq parts"] = ("kq_linear_q8", (act8_rows(9, 256, g), kq_parts, [Q4_K, Q5_K, Q6_K], [16, 16, 16], 256))
    # several types side by side in one call (the K-quant and the 32-weight slices together)
    k = 512
    parts = [(Q4_K, 24), (Q6_K, 8), (Q8_0, 8), (Q5_0, 5), (F16, 3)]
    raws = [torch.from_numpy(random_blocks(t, n, k, rng).reshape(-1)) for t, n in parts]
    for m in (1, 2, 8, 17):
        out[f"cat M={m}"] = ("gguf_linear_cat_q8", (act8_rows(m, k, g), raws, [t for t, _ in parts], [n for _, n in parts], k))
    # attention (its exp polynomial) and RMS norm, compiled under the wider flags too
    q, kc, vc = torch.randn(1, 4, 3, 64, generator=g), torch.randn(1, 2, 40, 64, generator=g), torch.randn(1, 2, 40, 64, generator=g)
    out["attend"] = ("attend", (q, kc, vc, 37, None, None))
    out["rms_norm"] = ("rms_norm", (torch.randn(5, 256, generator=g), torch.rand(256, generator=g), 1e-6))
    return out


def test_vnni_build_equals_the_avx2_build_bit_for_bit(tmp_path):
    if not kernels.ROWSTABLE_VNNI_FLAGS <= kernels._cpu_flags():
        pytest.skip("this CPU lacks AVX-512 VNNI / VL / BW: only the AVX2 build runs here")
    if kernels.rowstable_isa() != "avx512vnni":
        pytest.skip("SPECDEC_ROWSTABLE=avx2 is set: this process runs the AVX2 build")
    ops = need_kernels()
    assert ops.int_dot() == "avx512vnni"  # the build really compiled the VNNI path
    calls = cases()
    torch.save(calls, tmp_path / "cases.pt")
    env = dict(os.environ, SPECDEC_ROWSTABLE="avx2", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "cases.pt"), str(tmp_path / "avx2.pt")],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    avx2 = torch.load(tmp_path / "avx2.pt")
    assert avx2["int_dot"] == "avx2"
    differ = [key for key, (op, args) in calls.items() if not torch.equal(getattr(ops, op)(*args), avx2[key])]
    assert not differ, f"{len(differ)} of {len(calls)} calls differ between the builds, e.g. {differ[:5]}"
