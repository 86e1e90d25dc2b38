"""kq_linear_q8 (specdec/kernels/rowstable.cpp): Q4_K / Q5_K / Q6_K matrices on 8-bit activations over
their blocks repacked in groups of 16 outputs (models/gguf_blocks.pack_q4_k_i8 / pack_q5_k_i8 /
pack_q6_k_i8).

Oracles: `gguf.quants.dequantize` of the same bytes (the gguf package's own dequantiser) by the
activations rounded as kernels.act8_slices states, in float64 (closeness within float32 rounding;
a misplaced quant, scale or min moves an output by far more); a row computed alone (row stability:
bit for bit at any row count, every tile size); the separate products side by side (several parts
in one call). A kernel fed a corrupted layout fails the oracle (the check can fail). The AVX2 build's
equality to the VNNI build is in test_vnni.py. Skipped where the kernels cannot run.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize

from model_helpers import need_kernels
from gguf_random import NAMES, Q4_K, Q5_K, Q6_K, act8_rows, random_blocks
from specdec import kernels
from specdec.models import gguf_blocks as gb

KQ = (Q4_K, Q5_K, Q6_K)
ROWS = (*range(1, 10), 14, 16, 17, 33)


def case(t: int, n: int, k: int, seed: int, saturated: bool = False):
    """(raw [n, row bytes] uint8, gguf's dequantised float64 [n, k]); saturated: every quant at its
    largest (Q4_K 15, Q5_K 31, Q6_K 63), the integer sums at their largest magnitude."""
    raw = random_blocks(t, n, k, np.random.default_rng(seed)).reshape(n * k // 256, -1).copy()
    if saturated:
        a, b = {Q4_K: (16, 144), Q5_K: (16, 176), Q6_K: (0, 192)}[t]
        raw[:, a:b] = 0xFF
    raw = raw.reshape(n, -1)
    w = np.asarray(dequantize(raw, GGMLQuantizationType(t)), dtype=np.float64).reshape(n, k)
    return raw, w


def close_to_oracle(y: torch.Tensor, x: torch.Tensor, w: np.ndarray) -> bool:
    """y within float32 rounding (1e-5 of sum |x8 w|) of the rounded activations' float64 product."""
    xq, _ = kernels.act8_slices(x.numpy(), 256)
    return bool((np.abs(y.double().numpy() - xq @ w.T) <= 1e-5 * (np.abs(xq) @ np.abs(w).T) + 1e-30).all())


@pytest.mark.parametrize("t", KQ, ids=[NAMES[t] for t in KQ])
@pytest.mark.parametrize("saturated", [False, True], ids=["random", "saturated"])
def test_products_are_the_rounded_activations_products_at_every_row_count(t, saturated):
    ops = need_kernels()
    g = torch.Generator().manual_seed(t)
    for n, k in [(16, 256), (48, 768)]:
        raw, w = case(t, n, k, seed=t + k, saturated=saturated)
        packed = gb.pack_k_i8(raw, t)
        assert packed.numel() == n // 16 * k // 256 * gb.KQ_BLOCK_BYTES[t]
        for m in ROWS:
            x = act8_rows(m, k, g)
            y = ops.kq_linear_q8(x, [packed], [t], [n], k)
            assert close_to_oracle(y, x, w), (NAMES[t], n, k, m)
            for i in range(m):
                assert torch.equal(y[i], ops.kq_linear_q8(x[i:i + 1], [packed], [t], [n], k)[0]), (n, k, m, i)
        x3 = act8_rows(6, k, g).view(2, 3, k)
        assert torch.equal(ops.kq_linear_q8(x3, [packed], [t], [n], k),
                           ops.kq_linear_q8(x3.reshape(6, k), [packed], [t], [n], k).view(2, 3, n))


def test_parts_side_by_side_and_threads():
    """q, k, v of mixed types in one call: each part's product, side by side; 1 or 2 threads alike."""
    ops = need_kernels()
    g = torch.Generator().manual_seed(3)
    k = 512
    parts = [(Q4_K, 64, 1), (Q4_K, 16, 2), (Q6_K, 32, 3)]
    cases = [(t, n, *case(t, n, k, seed)) for t, n, seed in parts]
    packed = [gb.pack_k_i8(raw, t) for t, n, raw, _ in cases]
    types, ns = [c[0] for c in cases], [c[1] for c in cases]
    threads = torch.get_num_threads()
    for m in (1, 4, 11):
        x = act8_rows(m, k, g)
        y = ops.kq_linear_q8(x, packed, types, ns, k)
        alone = [ops.kq_linear_q8(x, [p], [t], [n], k) for p, t, n in zip(packed, types, ns)]
        assert torch.equal(y, torch.cat(alone, dim=1)), m
        assert close_to_oracle(y, x, np.concatenate([c[3] for c in cases])), m
        try:
            torch.set_num_threads(1 if threads > 1 else 2)
            assert torch.equal(ops.kq_linear_q8(x, packed, types, ns, k), y), m
        finally:
            torch.set_num_threads(threads)


@pytest.mark.parametrize("t", KQ, ids=[NAMES[t] for t in KQ])
def test_a_broken_layout_fails_the_oracle(t):
    """The oracle can fail: the same bytes with one sub-block's scales of each group swapped with
    the next one's, or two quant vectors exchanged, are far from the dequantised product."""
    ops = need_kernels()
    k, n = 256, 16
    raw, w = case(t, n, k, seed=9)
    x = act8_rows(4, k, torch.Generator().manual_seed(1))
    good = gb.pack_k_i8(raw, t)
    assert close_to_oracle(ops.kq_linear_q8(x, [good], [t], [n], k), x, w)
    scales = 32 if t == Q6_K else 64  # where the sub-block scales start
    quants = 288 if t == Q6_K else 320
    for a, b in [(scales, scales + 16), (quants, quants + 64)]:
        bad = good.clone()
        bad[a:a + 16], bad[b:b + 16] = good[b:b + 16], good[a:a + 16]
        assert not close_to_oracle(ops.kq_linear_q8(x, [bad], [t], [n], k), x, w), (a, b)


def test_bad_inputs_give_one_clear_error():
    ops = need_kernels()
    raw, _ = case(Q4_K, 16, 256, seed=1)
    packed = gb.pack_k_i8(raw, Q4_K)
    x = torch.randn(2, 256)
    with pytest.raises(RuntimeError, match="takes 2368 bytes"):
        ops.kq_linear_q8(x, [packed[:-1]], [Q4_K], [16], 256)
    with pytest.raises(RuntimeError, match="not Q4_K"):
        ops.kq_linear_q8(x, [packed], [2], [16], 256)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        ops.kq_linear_q8(torch.randn(2, 128), [packed], [Q4_K], [16], 128)
    assert gb.pack_k_i8(raw[:15], Q4_K) is None  # (N not a multiple of 16: not repacked)
