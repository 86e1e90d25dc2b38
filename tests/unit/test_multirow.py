"""Steps of several tokens (chains, trees, batches: 2-33 rows) on the row-stable kernels' products.

A verification step multiplies T activation rows by each weight block at once (the VNNI build: two
weight rows a pass, kz_pass, iz_tile, bz_tile in rowstable.cpp; row tiles of up to 6-8 rows, as even as T
allows). Whatever the tiling, each row must get the numbers it gets alone (greedy speculation
equals plain greedy only so). Oracles: the row multiplied alone (bit for bit), and
`gguf.quants.dequantize` of the same bytes by a float64 product of the activations as the kernels
round them (kernels.act8_slices; within float32 rounding) and of the unrounded activations (within
kernels.act8_error_bound); for the repacked Q4_1 / Q8_0 blocks, `linear` over the dequantised
weights bit for bit. The VNNI build against the AVX2 build: tests/unit/test_vnni.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize

from model_helpers import need_kernels
from gguf_random import NAMES, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, random_blocks
from specdec import kernels

INT_TYPES = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)
# every row tile of the integer paths, single and split (2-8 rows, 9-17 in two tiles, 24-33 in 3-5)
ROWS = (*range(2, 18), 24, 32, 33)


def activations(m: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Rows with outliers (each slice's own scale matters), an all-zero slice, a row of ones."""
    x = torch.randn(m, k, generator=g) * (0.05 + 8 * torch.rand(m, k, generator=g) ** 6)
    x[0, :32] = 0.0
    x[m // 2] = 1.0
    return x


@pytest.mark.parametrize("t", INT_TYPES, ids=[NAMES[t] for t in INT_TYPES])
def test_each_row_of_a_multirow_product_is_its_product_alone_and_gguf_dequantize_s(t):
    """T rows at once, for every T in ROWS, by 7 weight rows (3 pairs and an odd one) and by 8 (pairs
    only), one block and several: each output row equals that row multiplied alone, bit for bit, and
    the float64 product over gguf.quants.dequantize's weights within the 8-bit rounding's bound."""
    ops = need_kernels()
    g = torch.Generator().manual_seed(t)
    bs = kernels.GGUF_TYPES[NAMES[t]].block_size
    for n, k in ((7, 2 * max(bs, 256)), (8, 256 if bs == 256 else 96)):
        raw_np = random_blocks(t, n, k, np.random.default_rng(n * t))
        raw = torch.from_numpy(raw_np.reshape(-1))
        w = np.asarray(dequantize(raw_np, GGMLQuantizationType(t)), dtype=np.float64).reshape(n, k)
        x_all = activations(max(ROWS), k, g)
        alone = torch.cat([ops.gguf_linear_q8(x_all[i:i + 1], raw, t, n, k) for i in range(max(ROWS))])
        for m in ROWS:
            x = x_all[:m]
            y = ops.gguf_linear_q8(x, raw, t, n, k)
            assert torch.equal(y, alone[:m]), (NAMES[t], n, k, m)
        yd, xn = alone.double().numpy(), x_all.numpy()
        xq, _ = kernels.act8_slices(xn, kernels.ACT8_SLICE[t])
        assert (np.abs(yd - xq @ w.T) <= 1e-5 * (np.abs(xq) @ np.abs(w).T) + 1e-30).all(), (NAMES[t], n, k)
        assert (np.abs(yd - xn.astype(np.float64) @ w.T) <= kernels.act8_error_bound(xn, w, t)).all(), (NAMES[t], n, k)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_repacked_blocks_multirow_products_are_the_dequantised_copys(kind):
    """q4_1_linear / q8_0_linear (decoding steps of projections whose parts are all Q4_0 / Q4_1 or
    all Q8_0) over a GGUF tensor's blocks repacked: `linear` over gguf.quants.dequantize's weights
    bit for bit, at every row count, so each row also equals its product alone."""
    from specdec.models import gguf_blocks as gb

    ops = need_kernels()
    t = {"Q4_1": Q4_1, "Q8_0": Q8_0}[kind]
    n, k = 24, 160
    raw = random_blocks(t, n, k, np.random.default_rng(3))
    w = torch.from_numpy(np.ascontiguousarray(dequantize(raw, GGMLQuantizationType(t)), dtype=np.float32).reshape(n, k))
    packed = gb._pack_q8(*gb._q8(raw)) if kind == "Q8_0" else gb._pack_q4(*gb._q4(raw, kind))
    op = ops.q8_0_linear if kind == "Q8_0" else ops.q4_1_linear
    g = torch.Generator().manual_seed(5)
    x_all = torch.randn(max(ROWS), k, generator=g)
    alone = torch.cat([op(x_all[i:i + 1], packed, n) for i in range(max(ROWS))])
    assert torch.equal(alone, ops.linear(x_all, w))
    for m in (1, *ROWS):
        assert torch.equal(op(x_all[:m], packed, n), alone[:m]), (kind, m)


def i8_packed(t: int, raw: np.ndarray):
    """(q4_1_linear_q8 or q8_0_linear_q8, the blocks of raw [n, row bytes] in its layout)."""
    from specdec.models import gguf_blocks as gb

    ops = need_kernels()
    if t == Q8_0:
        return ops.q8_0_linear_q8, gb.pack_q8_i8(*gb._q8(raw))
    return ops.q4_1_linear_q8, gb.pack_q4_i8(*gb._q4(raw, NAMES[t]))


@pytest.mark.parametrize("t", (Q4_0, Q4_1, Q8_0), ids=["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("kind", ["random", "extreme"])
def test_repacked_blocks_on_8bit_activations_give_each_row_its_own_product(t, kind):
    """q4_1_linear_q8 / q8_0_linear_q8 (the default model's projections and head on 8-bit
    activations, over its blocks repacked in groups of 16 outputs): every row count (1-33, one
    row tile and several) and one thread or two give each row its numbers alone, bit for bit; they
    are the float64 product of the activations as gguf_linear_q8 rounds them (kernels.act8_slices)
    by gguf.quants.dequantize's weights within float32 rounding, and the unrounded product within
    kernels.act8_error_bound. "extreme": every quant at its largest magnitude (15; Q8_0 -128) by
    rows of +-1 (q_x = +-127 throughout), the AVX2 build's int16 sums at their limits."""
    from oracle import one_thread

    bb = kernels.GGUF_TYPES[NAMES[t]].block_bytes
    n, k = 48, 320
    raw = random_blocks(t, n, k, np.random.default_rng(t))
    if kind == "extreme":
        blocks = raw.reshape(-1, bb)
        blocks[:, bb - (32 if t == Q8_0 else 16):] = 0x80 if t == Q8_0 else 0xFF
    w = np.asarray(dequantize(raw, GGMLQuantizationType(t)), dtype=np.float64).reshape(n, k)
    op, packed = i8_packed(t, raw)
    g = torch.Generator().manual_seed(t)
    x_all = activations(max(ROWS), k, g)
    if kind == "extreme":
        x_all[1::2] = torch.sign(x_all[1::2]) + (x_all[1::2] == 0)
    alone = torch.cat([op(x_all[i:i + 1], packed, n) for i in range(max(ROWS))])
    for m in (1, *ROWS):
        assert torch.equal(op(x_all[:m], packed, n), alone[:m]), (NAMES[t], m)
    with one_thread():
        assert torch.equal(op(x_all, packed, n), alone)
    yd, xn = alone.double().numpy(), x_all.numpy()
    xq, _ = kernels.act8_slices(xn, 32)
    assert (np.abs(yd - xq @ w.T) <= 1e-5 * (np.abs(xq) @ np.abs(w).T) + 1e-30).all()
    assert (np.abs(yd - xn.astype(np.float64) @ w.T) <= kernels.act8_error_bound(xn, w, t)).all()


def test_repacked_8bit_layouts_refuse_what_they_cannot_hold():
    """pack_q4_i8 / pack_q8_i8 take groups of 16 outputs and float16 scales (Q4_0's m = -8 d can
    overflow one): otherwise None, and the projection stays on the float path's layout; the kernels
    refuse blocks of the wrong size with one clear error."""
    from specdec.models import gguf_blocks as gb

    ops = need_kernels()
    raw = random_blocks(Q4_0, 16, 64, np.random.default_rng(1))
    q, d, m = gb._q4(raw, "Q4_0")
    assert gb.pack_q4_i8(q[:8], d[:8], m[:8]) is None  # 8 outputs: not a group of 16
    big = d.copy()
    big[0, 0] = 9000.0  # a float16 scale whose -8 d is past float16's range
    assert gb.pack_q4_i8(q, big, (-8.0 * big).astype(np.float32)) is None
    packed = gb.pack_q4_i8(q, d, m)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ops.q4_1_linear_q8(torch.zeros(1, 64), packed[:-1], 16)
