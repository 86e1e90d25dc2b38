"""Q4_1 / Q8_0 blocks packed K-major for the row-stable kernels' q4_1_linear / q8_0_linear (float
path) and q4_1_linear_q8 / q8_0_linear_q8 (8-bit activations); Q4_K / Q5_K / Q6_K blocks for kq_linear_q8.

A GGUF file's own model reads the file's bytes as they lie (models/gguf_model.py); what is packed
here are a GGUF file's Q4_0 / Q4_1 / Q8_0 matrices for its decoding steps (decoded from the file's
bytes by `_q4` / `_q8`, packed by `_pack_q4` / `_pack_q8`: gguf_model.repack_for_steps), and the
Q8_0 copies drafters make of their own float weights (`quantize_q8_0`: a drafting step then reads
~1 byte a weight). The decoders are checked against gguf.quants.dequantize of the same bytes
(tests/unit/test_gguf_blocks.py), so nothing needs an fp32 copy of a model.

Layout (see rowstable.cpp's block_linear): K-major, output rows in groups of 4; per group and
32-weight block, Q4_1: d[4], m[4] as float32 then 4 x 16 nibble bytes; Q8_0: d[4] as float32 then
4 x 32 int8. Q4_0 (w = d (q - 8)) is stored as Q4_1 with m = -8 d, which rebuilds the same values
exactly. The 8-bit activations' layout (`pack_q4_i8` / `pack_q8_i8`, see rowstable.cpp's
block_linear_q8) groups 16 output rows and interleaves their quants 4 bytes at a time, so that one
integer dot-product instruction takes the same 4 weights of all 16 outputs; `pack_q4_k_i8` /
`pack_q5_k_i8` / `pack_q6_k_i8` do the same for a file's Q4_K / Q5_K / Q6_K matrices (rowstable.cpp's
kq_linear_q8), read
straight from the file's bytes.

This module knows nothing about tokenizers, sampling or the engine.
"""

from __future__ import annotations

import numpy as np
import torch

G = 4  # output rows per group


def _q4(raw: np.ndarray, kind: str):
    """raw [N, nb * bytes] -> (q [N, nb, 16] uint8 nibbles, d, m [N, nb] float32)."""
    N = raw.shape[0]
    if kind == "Q4_1":
        b = raw.reshape(N, -1, 20)
        d = b[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        m = b[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        return np.ascontiguousarray(b[:, :, 4:20]), d, m
    b = raw.reshape(N, -1, 18)  # Q4_0: d, then 16 bytes; w = d * (q - 8)
    d = b[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    return np.ascontiguousarray(b[:, :, 2:18]), d, (-8.0 * d).astype(np.float32)


def _q8(raw: np.ndarray):
    """raw [N, nb * 34] -> (q [N, nb, 32] int8, d [N, nb] float32)."""
    b = raw.reshape(raw.shape[0], -1, 34)
    d = b[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    return np.ascontiguousarray(b[:, :, 2:34]).view(np.int8), d


def _dequant_q4(q, d, m) -> np.ndarray:
    lo, hi = (q & 0x0F).astype(np.float32), (q >> 4).astype(np.float32)
    w = np.concatenate([lo, hi], axis=2) * d[..., None] + m[..., None]  # d * q exact in fp32: one rounding
    return w.reshape(q.shape[0], -1)


def _dequant_q8(q, d) -> np.ndarray:
    return (q.astype(np.float32) * d[..., None]).reshape(q.shape[0], -1)


def _pack_q4(q, d, m) -> torch.Tensor:
    N, nb = d.shape
    dd = np.ascontiguousarray(d.reshape(N // G, G, nb).transpose(0, 2, 1)).view(np.uint8)  # [N/G, nb, 16]
    mm = np.ascontiguousarray(m.reshape(N // G, G, nb).transpose(0, 2, 1)).view(np.uint8)
    qq = q.reshape(N // G, G, nb, 16).transpose(0, 2, 1, 3).reshape(N // G, nb, G * 16)
    return torch.from_numpy(np.ascontiguousarray(np.concatenate([dd, mm, qq], axis=2)).reshape(-1))


def _pack_q8(q, d) -> torch.Tensor:
    N, nb = d.shape
    dd = np.ascontiguousarray(d.reshape(N // G, G, nb).transpose(0, 2, 1)).view(np.uint8)
    qq = np.ascontiguousarray(q.reshape(N // G, G, nb, 32).transpose(0, 2, 1, 3)).view(np.uint8)
    return torch.from_numpy(np.ascontiguousarray(np.concatenate([dd, qq.reshape(N // G, nb, G * 32)], axis=2)).reshape(-1))


GI8 = 16  # output rows per group of the 8-bit-activation layout


def _f16_exact(a: np.ndarray) -> np.ndarray | None:
    """a (float32) as float16, or None where some value is not a float16 (Q4_0's m = -8 d overflowing)."""
    with np.errstate(over="ignore"):
        h = a.astype(np.float16)
    return h if np.array_equal(h.astype(np.float32), a) else None


def pack_q4_i8(q, d, m) -> torch.Tensor | None:
    """Q4_1 blocks (q [N, nb, 16] nibble bytes, d, m [N, nb]; Q4_0 as Q4_1 with m = -8 d) in
    rowstable.cpp's q4_1_linear_q8 layout: output rows in groups of 16, K-major; per group and
    block d[16], m[16] as float16, then 4 x 64 bytes, vector t holding bytes 4t..4t+3 of each
    output's 16 in turn. None where a d or m is not a float16 (or N not a multiple of 16)."""
    N, nb = d.shape
    dh, mh = _f16_exact(d), _f16_exact(m)
    if dh is None or mh is None or N % GI8:
        return None
    n = N // GI8
    dd = np.ascontiguousarray(dh.reshape(n, GI8, nb).transpose(0, 2, 1)).view(np.uint8)  # [n, nb, 32]
    mm = np.ascontiguousarray(mh.reshape(n, GI8, nb).transpose(0, 2, 1)).view(np.uint8)
    qq = q.reshape(n, GI8, nb, 4, 4).transpose(0, 2, 3, 1, 4).reshape(n, nb, 256)
    return torch.from_numpy(np.ascontiguousarray(np.concatenate([dd, mm, qq], axis=2)).reshape(-1))


def pack_q8_i8(q, d) -> torch.Tensor | None:
    """Q8_0 blocks (q [N, nb, 32] int8, d [N, nb]) in q8_0_linear_q8's layout: groups of 16 output
    rows, K-major; per group and block d[16] as float16, -(sum of each output's 32 quants) as
    int16 [16], then 8 x 64 bytes, vector j holding quants 4j..4j+3 of each output in turn."""
    N, nb = d.shape
    dh = _f16_exact(d)
    if dh is None or N % GI8:
        return None
    n = N // GI8
    dd = np.ascontiguousarray(dh.reshape(n, GI8, nb).transpose(0, 2, 1)).view(np.uint8)
    neg = (-q.astype(np.int32).sum(axis=2)).astype(np.int16)  # [N, nb], |sum| <= 4096
    ss = np.ascontiguousarray(neg.reshape(n, GI8, nb).transpose(0, 2, 1)).view(np.uint8)
    qq = np.ascontiguousarray(q.reshape(n, GI8, nb, 8, 4).transpose(0, 2, 3, 1, 4)).view(np.uint8).reshape(n, nb, 512)
    return torch.from_numpy(np.ascontiguousarray(np.concatenate([dd, ss, qq], axis=2)).reshape(-1))


def blocks_op(ops, kind: str):
    """The row-stable kernel (of `ops`) that multiplies by blocks of `kind`: quantize_q8_0's, or a
    GGUF file's Q4_1 / Q8_0 repacked K-major; None for a kind those kernels do not read."""
    return {"Q4_1": ops.q4_1_linear, "Q8_0": ops.q8_0_linear,
            "Q8_0i8": getattr(ops, "q8_0_linear_q8", None)}.get(kind)


def q8_0_kind(rows: int, act8: bool) -> str:
    """The layout quantize_q8_0 packs `rows` output rows in: "Q8_0i8" (q8_0_linear_q8) on 8-bit
    activations where the rows are a multiple of 16, else "Q8_0" (K-major, q8_0_linear)."""
    return "Q8_0i8" if act8 and rows % GI8 == 0 else "Q8_0"


def quantize_q8_0(w: torch.Tensor, act8: bool = False) -> tuple | None:
    """A drafter's own weight [N, K] as Q8_0 blocks (d = max |w| / 127 per 32 weights, rounded to
    float16 as GGUF stores it): (kind, blocks, rows), or None when K is not a multiple of 32 or N
    of 4. kind "Q8_0": K-major for q8_0_linear (float activations); with `act8` and N a multiple
    of 16, "Q8_0i8": pack_q8_i8's layout for q8_0_linear_q8 (8-bit activations: a drafter's
    products several times faster, docs/benchmarks.md). Lossy (~0.4% of a block's largest weight at most, and the activations' own
    rounding on the 8-bit path), which is fine for a drafter: exactness never depends on the
    drafter's numbers."""
    N, K = w.shape
    if K % 32 or N % G:
        return None
    b = w.detach().float().reshape(N, K // 32, 32).numpy()
    d = (np.abs(b).max(axis=2) / 127.0).astype(np.float16).astype(np.float32)  # [N, nb]
    safe = np.where(d > 0, d, 1.0)
    q = np.clip(np.rint(b / safe[..., None]), -127, 127).astype(np.int8)
    if q8_0_kind(N, act8) == "Q8_0i8":
        return "Q8_0i8", pack_q8_i8(q, d), N  # (d is a float16 already, so pack_q8_i8 takes it)
    return "Q8_0", _pack_q8(q, d), N


# -- K-quants on 8-bit activations (rowstable.cpp's kq_linear_q8) -------------------------------
KQ_TYPES = {12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}  # ggml type -> name, of the types kq_linear_q8 reads
KQ_BLOCK_BYTES = {12: 2368, 13: 2880, 14: 3360}  # a group of 16 outputs' 256-weight block, repacked


def _group_k(a: np.ndarray, n: int, nb: int) -> np.ndarray:
    """a [N, nb, ...] per output and block -> [N / 16, nb, 16, ...] (groups of 16 outputs, K-major)."""
    return a.reshape(n, GI8, nb, *a.shape[2:]).swapaxes(1, 2)


def _quad_vectors(q: np.ndarray) -> np.ndarray:
    """q [n, nb, 16, 256] (a group's outputs' weights, one byte each) -> [n, nb, 64, 64]: vector u
    holding in bytes 4j..4j+3 the weights 4u..4u+3 of output j."""
    n, nb = q.shape[:2]
    return q.reshape(n, nb, GI8, 64, 4).swapaxes(2, 3).reshape(n, nb, 64, 64)


def _k_groups(raw: np.ndarray, block_bytes: int):
    """A K-quant matrix's rows raw [N, nb * block_bytes] as (blocks [N, nb, block_bytes], N, groups of
    16 outputs, nb); None where N is not a multiple of 16 (or a row not whole blocks)."""
    N = raw.shape[0]
    if N % GI8 or raw.shape[1] % block_bytes:
        return None
    nb = raw.shape[1] // block_bytes
    return raw.reshape(N, nb, block_bytes), N, N // GI8, nb


def pack_q4_k_i8(raw: np.ndarray) -> torch.Tensor | None:
    """Q4_K rows (raw [N, nb * 144], the file's bytes) in rowstable.cpp's kq_linear_q8 layout: groups
    of 16 outputs, K-major; per group and block d[16], dmin[16] (float16), sc[8][16], m[8][16]
    (bytes), then 32 vectors of 64 bytes, vector 8p + t holding each output's quant bytes
    32p + 4t..32p + 4t + 3 in turn (low nibbles: weights 64p + 4t.., high: 64p + 32 + 4t..). 2368
    bytes a group's block (the file's 16 blocks: 2304). None where N is not a multiple of 16."""
    if (grouped := _k_groups(raw, 144)) is None:
        return None
    b, _, n, nb = grouped
    qs = _group_k(b[:, :, 16:144], n, nb)  # [n, nb, 16, 128]: bytes 32p + 4t + e
    qv = qs.reshape(n, nb, GI8, 32, 4).swapaxes(2, 3).reshape(n, nb, 2048)
    out = np.concatenate([_k_scales(b, n, nb), qv], axis=2)
    return torch.from_numpy(np.ascontiguousarray(out).reshape(-1))


def _k_scales(b: np.ndarray, n: int, nb: int) -> np.ndarray:
    """Q4_K / Q5_K blocks b [N, nb, block bytes] -> their groups' d[16], dmin[16] (float16 bytes),
    sc[8][16], m[8][16] (the 6-bit scales and mins unpacked to bytes): uint8 [n, nb, 320]."""
    from gguf.quants import Q4_K

    N = b.shape[0]
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(b[:, :, 4:16]).reshape(-1, 12))
    dd = _group_k(b[:, :, 0:2], n, nb).reshape(n, nb, 32)
    dm = _group_k(b[:, :, 2:4], n, nb).reshape(n, nb, 32)
    scs = _group_k(sc.reshape(N, nb, 8), n, nb).swapaxes(2, 3).reshape(n, nb, 128)  # [s][output]
    ms = _group_k(m.reshape(N, nb, 8), n, nb).swapaxes(2, 3).reshape(n, nb, 128)
    return np.concatenate([dd, dm, scs.astype(np.uint8), ms.astype(np.uint8)], axis=2)


def pack_q5_k_i8(raw: np.ndarray) -> torch.Tensor | None:
    """Q5_K rows (raw [N, nb * 176]) in kq_linear_q8's layout: pack_q4_k_i8's (d, dmin, sc, m, then 32
    vectors of the quants' low 4 bits), then 8 vectors of their fifth bits: vector k holding in bit
    2j of each output's byte that of quad 16j + k, in bit 2j + 1 that of quad 16j + 8 + k (the low
    and high nibbles of vector 8j + k). 2880 bytes a group's block (the file's 16 blocks: 2816).
    None where N is not a multiple of 16."""
    if (grouped := _k_groups(raw, 176)) is None:
        return None
    b, N, n, nb = grouped
    # the quants q (0-31) in weight order, as gguf.quants.Q5_K reads them
    ql = b[:, :, 48:176].reshape(N, nb, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    qh = b[:, :, 16:48].reshape(N, nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    q = ((ql & 0x0F).reshape(N, nb, 8, 32) | ((qh & 0x01) << 4)).reshape(N, nb, 256)
    quads = _quad_vectors(_group_k(q, n, nb)).reshape(n, nb, 4, 2, 8, 64)  # [j][half][k]: quad 16j + 8 half + k
    lo = (quads[:, :, :, 0] & 0x0F) | ((quads[:, :, :, 1] & 0x0F) << 4)  # vector 8j + k
    hi = (quads >> 4).astype(np.uint8)  # the fifth bits
    hv = np.zeros((n, nb, 8, 64), dtype=np.uint8)
    for j in range(4):
        hv |= (hi[:, :, j, 0] << (2 * j)) | (hi[:, :, j, 1] << (2 * j + 1))
    out = np.concatenate([_k_scales(b, n, nb), lo.reshape(n, nb, 2048), hv.reshape(n, nb, 512)], axis=2)
    return torch.from_numpy(np.ascontiguousarray(out.astype(np.uint8, copy=False)).reshape(-1))


def pack_q6_k_i8(raw: np.ndarray) -> torch.Tensor | None:
    """Q6_K rows (raw [N, nb * 210]) in kq_linear_q8's layout: groups of 16 outputs, K-major; per
    group and block d[16] (float16), sc[16][16] (int8), then 32 vectors of the quants' low 4 bits
    (vector v: quad v in the low nibbles, quad v + 32 in the high ones; quad u = weights 4u..4u+3
    of each output in turn) and 16 of their high 2 bits (vector w: quad w + 16c in bits 2c, 2c + 1).
    3360 bytes a group's block, as the file's 16 blocks. None where N is not a multiple of 16."""
    if (grouped := _k_groups(raw, 210)) is None:
        return None
    b, N, n, nb = grouped
    # the quants q (0-63) in weight order, as gguf.quants.Q6_K reads them
    ql = b[:, :, 0:128].reshape(N, nb, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    ql = (ql & 0x0F).reshape(N, nb, 2, 128)
    qh = b[:, :, 128:192].reshape(N, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
    qh = (qh & 0x03).reshape(N, nb, 2, 128)
    q = (ql | (qh << 4)).reshape(N, nb, 256)
    quads = _quad_vectors(_group_k(q, n, nb))  # [n, nb, 64, 64]
    lo = (quads[:, :, :32] & 0x0F) | ((quads[:, :, 32:] & 0x0F) << 4)
    hi = quads >> 4
    hv = hi[:, :, 0:16] | (hi[:, :, 16:32] << 2) | (hi[:, :, 32:48] << 4) | (hi[:, :, 48:64] << 6)
    dd = _group_k(b[:, :, 208:210], n, nb).reshape(n, nb, 32)
    scs = _group_k(b[:, :, 192:208], n, nb).swapaxes(2, 3).reshape(n, nb, 256)  # [sub-block][output]
    out = np.concatenate([dd, scs, lo.reshape(n, nb, 2048), hv.reshape(n, nb, 1024)], axis=2)
    return torch.from_numpy(np.ascontiguousarray(out.astype(np.uint8, copy=False)).reshape(-1))


def pack_k_i8(raw: np.ndarray, ggml_type: int) -> torch.Tensor | None:
    """A Q4_K / Q5_K / Q6_K matrix's file bytes in kq_linear_q8's layout (pack_q4_k_i8 /
    pack_q5_k_i8 / pack_q6_k_i8)."""
    packers = {12: pack_q4_k_i8, 13: pack_q5_k_i8, 14: pack_q6_k_i8}
    return packers[ggml_type](raw) if ggml_type in packers else None
