"""gguf_linear / gguf_rows (specdec/kernels/rowstable.cpp): products and row lookups straight from
a GGUF tensor's bytes, for every type the kernels read.

Oracles: `gguf.quants.dequantize` (the gguf package's own dequantiser, independent of these
kernels) followed by a float64 product (closeness) and by the fp32 `linear` kernel (bit equality:
the kernels claim the same numbers for every type); a row computed alone (row stability: a token's
outputs do not depend on the other rows in the call). Random blocks of every type from
gguf_random.random_blocks. Skipped where the kernels cannot run (no AVX2 / FMA / F16C, no compiler).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize

from model_helpers import need_kernels
from gguf_random import BF16, F16, F32, NAMES, Q4_K, Q5_K, Q6_K, SIZES, TYPES, random_blocks
from specdec import kernels
from specdec.types import SpecdecError

FLOAT_TYPES = (F32, F16, BF16)


def case(t: int, n: int, k: int, seed: int):
    """(raw bytes as a flat uint8 tensor, gguf's dequantised float32 [n, k] weights)."""
    raw = random_blocks(t, n, k, np.random.default_rng(seed))
    w = np.ascontiguousarray(dequantize(raw, GGMLQuantizationType(t)), dtype=np.float32).reshape(n, k)
    return torch.from_numpy(raw.reshape(-1)), torch.from_numpy(w)


def shapes(t: int) -> list[tuple[int, int]]:
    """[N, K] cases: N with and without a remainder of the kernels' 4- and 2-row tiles, K of one and
    several blocks (float types: also K that is no multiple of 8, the k % 8 tail)."""
    bs = SIZES[t][0]
    ks = [256, 512] if bs == 256 else [32, 96, 512]
    out = [(13, ks[-1]), (6, ks[0]), (1, ks[0])]
    return out + ([(5, 37), (9, 24)] if t in FLOAT_TYPES else [(7, ks[1])])


def test_type_table_matches_gguf_and_the_random_blocks():
    from gguf.constants import GGML_QUANT_SIZES

    assert {t.id for t in kernels.GGUF_TYPES.values()} == set(TYPES)
    for name, t in kernels.GGUF_TYPES.items():
        assert GGMLQuantizationType(t.id).name == name == NAMES[t.id]
        assert GGML_QUANT_SIZES[GGMLQuantizationType(t.id)] == (t.block_size, t.block_bytes) == SIZES[t.id]
        assert kernels.row_bytes(t.id, 2 * t.block_size * 8) == 16 * t.block_bytes
        assert random_blocks(t.id, 3, 256, np.random.default_rng(0)).shape == (3, kernels.row_bytes(t.id, 256))


@pytest.mark.parametrize("t", TYPES, ids=[NAMES[t] for t in TYPES])
def test_products_are_the_dequantised_weights_products(t):
    """Close to float64 over gguf's dequantised weights, and bit for bit `linear` over them, for row
    counts through the in-register path (1-6) and the buffered one (7, 64, 300), and [.., K] inputs."""
    ops = need_kernels()
    g = torch.Generator().manual_seed(t)
    for i, (n, k) in enumerate(shapes(t)):
        raw, w = case(t, n, k, seed=100 * t + i)
        for m in (1, 2, 3, 4, 5, 6, 7, 64, 300):
            x = torch.randn(m, k, generator=g)
            y = ops.gguf_linear(x, raw, t, n, k)
            ref = x.double() @ w.double().T
            bound = (k / 8 + 4) * 2.0**-24 * (x.double().abs() @ w.double().abs().T) + 1e-30
            assert ((y.double() - ref).abs() <= bound).all(), (NAMES[t], n, k, m)
            assert torch.equal(y, ops.linear(x, w)), (NAMES[t], n, k, m)
        x3 = torch.randn(2, 3, k, generator=g)
        assert torch.equal(ops.gguf_linear(x3, raw, t, n, k), ops.linear(x3, w))


def act8_inputs(m: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Activations with outliers (the per-slice scales matter) and, in row 0, an all-zero slice."""
    x = torch.randn(m, k, generator=g) * (0.05 + 8 * torch.rand(m, k, generator=g) ** 6)
    x[0, :min(k, 256)] = 0.0
    return x


@pytest.mark.parametrize("t", TYPES, ids=[NAMES[t] for t in TYPES])
def test_act8_products_are_the_rounded_activations_products(t):
    """gguf_linear_q8: for the quantised types, the float64 product of the activations rounded as
    kernels.act8_slices states (slices of kernels.ACT8_SLICE[t], max|x| / 127) by gguf's dequantised
    weights within float32 rounding, and so the unrounded product within kernels.act8_error_bound;
    the float types give gguf_linear's product bit for bit."""
    ops = need_kernels()
    g = torch.Generator().manual_seed(11 * t)
    for i, (n, k) in enumerate(shapes(t)):
        raw, w = case(t, n, k, seed=100 * t + i)
        wd = w.double().numpy()
        for m in (1, 2, 3, 4, 5, 7, 64):
            x = act8_inputs(m, k, g)
            y = ops.gguf_linear_q8(x, raw, t, n, k)
            if t not in kernels.ACT8_SLICE:
                assert torch.equal(y, ops.gguf_linear(x, raw, t, n, k)), (NAMES[t], m)
                continue
            yd = y.double().numpy()
            xq, _ = kernels.act8_slices(x.numpy(), kernels.ACT8_SLICE[t])
            assert (np.abs(yd - xq @ wd.T) <= 1e-5 * (np.abs(xq) @ np.abs(wd).T) + 1e-30).all(), (NAMES[t], n, k, m)
            exact = x.double().numpy() @ wd.T
            assert (np.abs(yd - exact) <= kernels.act8_error_bound(x.numpy(), wd, t)).all(), (NAMES[t], n, k, m)
        x3 = act8_inputs(6, k, g).view(2, 3, k)
        assert torch.equal(ops.gguf_linear_q8(x3, raw, t, n, k), ops.gguf_linear_q8(x3.reshape(6, k), raw, t, n, k).view(2, 3, n))


K_QUANTS = [t for t in TYPES if kernels.ACT8_SLICE.get(t) == 256]


def saturated_case(t: int, n: int, k: int, seed: int):
    """case() with every quant at its largest value (Q4_K 15, Q5_K 31, Q6_K 63 before its offset):
    the integer path's int16 sums of several products reach their largest magnitudes."""
    raw = random_blocks(t, n, k, np.random.default_rng(seed)).reshape(n * k // 256, -1).copy()
    quants = {Q4_K: [(16, 144)], Q5_K: [(16, 176)], Q6_K: [(0, 192)]}[t]  # (qh and) qs / ql and qh
    for a, b in quants:
        raw[:, a:b] = 0xFF
    w = np.ascontiguousarray(dequantize(raw.reshape(n, -1), GGMLQuantizationType(t)), dtype=np.float32).reshape(n, k)
    return torch.from_numpy(raw.reshape(-1)), torch.from_numpy(w)


@pytest.mark.parametrize("t", K_QUANTS, ids=[NAMES[t] for t in K_QUANTS])
def test_act8_k_quants_at_their_extremes_and_every_row_count(t):
    """gguf_linear_q8 on K-quant blocks whose quants are all at their largest, by activations that
    round to +-127 everywhere (the int16 sums of products at their largest magnitude) and by random
    ones, for every row count 1-17 and 32, 33 (the 16-row tiles of the integer path, full and
    ragged, one and several; one block and three): the rounded activations' product within float32
    rounding, and each row bit for bit the row computed alone."""
    ops = need_kernels()
    g = torch.Generator().manual_seed(t)
    for n, k in [(5, 256), (29, 768)]:
        raw, w = saturated_case(t, n, k, seed=t + k)
        wd = w.double().numpy()
        for m in [*range(1, 18), 32, 33]:
            x = act8_inputs(m, k, g)
            x[m // 2] = 1.0 if m % 2 else -1.0  # q = +-127 in every slice
            y = ops.gguf_linear_q8(x, raw, t, n, k)
            xq, _ = kernels.act8_slices(x.numpy(), 256)
            assert (np.abs(y.double().numpy() - xq @ wd.T) <= 1e-5 * (np.abs(xq) @ np.abs(wd).T) + 1e-30).all(), (n, k, m)
            for i in range(m):
                assert torch.equal(y[i], ops.gguf_linear_q8(x[i:i + 1], raw, t, n, k)[0]), (n, k, m, i)


@pytest.mark.parametrize("op", ["gguf_linear", "gguf_linear_q8"])
@pytest.mark.parametrize("t", TYPES, ids=[NAMES[t] for t in TYPES])
def test_a_rows_outputs_do_not_depend_on_the_other_rows_or_threads(t, op):
    """The same token's outputs bit for bit alone, and first, in the middle or last among 2-300 rows,
    with one thread or two, on the float path and on the 8-bit-activation one."""
    ops = need_kernels()
    gguf_linear = getattr(ops, op)
    k = 512
    raw, _ = case(t, 30, k, seed=t)
    g = torch.Generator().manual_seed(7 * t)
    tok = torch.randn(1, k, generator=g)
    alone = gguf_linear(tok, raw, t, 30, k)[0]
    for m in (2, 5, 7, 64, 300):
        others = torch.randn(m - 1, k, generator=g)
        for pos in sorted({0, m // 2, m - 1}):
            x = torch.cat([others[:pos], tok, others[pos:]])
            assert torch.equal(gguf_linear(x, raw, t, 30, k)[pos], alone), (NAMES[t], m, pos)
    threads = torch.get_num_threads()
    x = torch.cat([tok, torch.randn(8, k, generator=g)])
    try:
        torch.set_num_threads(1)
        one = gguf_linear(x, raw, t, 30, k)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, gguf_linear(x, raw, t, 30, k))
    assert torch.equal(one[0], alone)


@pytest.mark.parametrize("op", ["gguf_linear", "gguf_linear_q8"])
def test_a_product_shared_among_threads_is_the_one_threads_product(op):
    """A product of 100 tasks (24 weight rows each) on 1, 2, 3 and 7 threads (more threads than
    cores: threads that start late, tasks taken from another thread's share), several calls in a
    row: the same numbers bit for bit."""
    ops = need_kernels()
    gguf_linear = getattr(ops, op)
    n, k = 2400, 512
    raw, _ = case(Q4_K, n, k, seed=3)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gguf_linear(x, raw, Q4_K, n, k)
        for nt in (2, 3, 7):
            torch.set_num_threads(nt)
            for _ in range(5):
                assert torch.equal(gguf_linear(x, raw, Q4_K, n, k), one), nt
                assert torch.equal(gguf_linear(x[1:2], raw, Q4_K, n, k), one[1:2]), nt
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("t", TYPES, ids=[NAMES[t] for t in TYPES])
def test_rows_are_gguf_dequantised_rows(t):
    ops = need_kernels()
    for i, (n, k) in enumerate(shapes(t)):
        raw, w = case(t, n, k, seed=50 + i)
        ids = torch.tensor([n - 1, 0, n // 2, n - 1])
        assert torch.equal(ops.gguf_rows(raw, t, ids, k), w[ids]), (NAMES[t], n, k)
        assert ops.gguf_rows(raw, t, torch.tensor([], dtype=torch.long), k).shape == (0, k)


def test_bad_tensors_give_one_clear_error():
    ops = need_kernels()
    q4k = kernels.Q4_K
    raw, _ = case(q4k, 4, 512, seed=0)
    x = torch.randn(2, 512)
    with pytest.raises(RuntimeError, match=r"Q4_K \[5, 512\] takes 1440 bytes; the raw tensor holds 1152"):
        ops.gguf_linear(x, raw, q4k, 5, 512)
    with pytest.raises(RuntimeError, match="takes 1152 bytes; the raw tensor holds 1151"):
        ops.gguf_linear(x, raw[:-1], q4k, 4, 512)
    with pytest.raises(RuntimeError, match="whole blocks of 256 weights; K=384"):
        ops.gguf_linear(torch.randn(2, 384), raw[:864], q4k, 4, 384)
    with pytest.raises(RuntimeError, match="ggml type 10 is not one these kernels read"):
        ops.gguf_linear(x, raw, 10, 4, 512)
    with pytest.raises(RuntimeError, match="x must be float32"):
        ops.gguf_linear(torch.randn(2, 256), raw, q4k, 4, 512)
    with pytest.raises(RuntimeError, match="row 4 is outside 0..3"):
        ops.gguf_rows(raw, q4k, torch.tensor([0, 4]), 512)
    # the Python checks the loader runs before any product: SpecdecError naming the type
    with pytest.raises(SpecdecError, match="type Q2_K are not supported"):
        kernels.row_bytes(10, 512)
    with pytest.raises(SpecdecError, match="Q6_K row holds whole blocks of 256 weights; a row of 100"):
        kernels.row_bytes(kernels.Q6_K, 100)
    with pytest.raises(SpecdecError, match=r"Q4_K \[4, 512\] tensor takes 1152 bytes, but the file gives 1100"):
        kernels.check_gguf_tensor(raw[:1100], q4k, 4, 512, "blk.0.attn_q.weight")
    kernels.check_gguf_tensor(raw, q4k, 4, 512)


def test_cat_is_the_separate_products_side_by_side():
    """gguf_linear_cat over weights of mixed types (a q/k/v-like stack) equals the separate products
    concatenated, bit for bit, in both of the kernels' paths; mismatched lists are refused."""
    ops = need_kernels()
    k = 512
    parts = [(t, n) + case(t, n, k, seed=t)[:1] for t, n in ((kernels.Q4_K, 40), (kernels.Q6_K, 9), (kernels.Q8_0, 0),
                                                            (F16, 13))]
    g = torch.Generator().manual_seed(3)
    for m in (1, 3, 5, 64):
        x = torch.randn(m, k, generator=g)
        y = ops.gguf_linear_cat(x, [p[2] for p in parts], [p[0] for p in parts], [p[1] for p in parts], k)
        assert torch.equal(y, torch.cat([ops.gguf_linear(x, raw, t, n, k) for t, n, raw in parts], dim=1)), m
        y = ops.gguf_linear_cat_q8(x, [p[2] for p in parts], [p[0] for p in parts], [p[1] for p in parts], k)
        assert torch.equal(y, torch.cat([ops.gguf_linear_q8(x, raw, t, n, k) for t, n, raw in parts], dim=1)), m
    with pytest.raises(RuntimeError, match="one type and one row count for each raw tensor"):
        ops.gguf_linear_cat(x, [parts[0][2]], [parts[0][0], parts[1][0]], [40], k)
    with pytest.raises(RuntimeError, match=r"Q6_K \[10, 512\] takes 4200 bytes; the raw tensor holds 3780"):
        ops.gguf_linear_cat(x, [parts[0][2], parts[1][2]], [parts[0][0], parts[1][0]], [40, 10], k)
