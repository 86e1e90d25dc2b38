"""Q4_1 / Q8_0 blocks packed for the AVX-512 block kernels (specdec/kernels/qlinear.cpp) and the
AVX2 row-stable kernels' K-major layout.

A GGUF file's own model reads the file's bytes as they lie (models/gguf_model.py); what is packed
here are the Q8_0 copies drafters make of their own float weights (`quantize_q8_0`: a drafting
step then reads ~1 byte a weight), and blocks decoded from GGUF bytes (`_q4`, `_q8`) for tests and
benchmarks of the packed layouts. The decoders are checked against gguf.quants.dequantize of the
same bytes (tests/test_gguf_blocks.py), so nothing needs an fp32 copy of a model.

Layouts (see qlinear.cpp): K-major, output rows in groups of 4; per group and 32-weight block,
Q4_1: d[4], m[4] as float32 then 4 x 16 nibble bytes; Q8_0: d[4] as float32 then 4 x 32 int8.
N-major, tiles of 16 outputs; per tile and block, Q4_1: d[16], m[16], then 16 x 16 bytes (weight
i of each output); Q8_0: d[16], then 32 x 16 int8. Both are kept: the kernels for 1-2 rows read
the first, those for 3-16 rows the second. VNNI (the integer kernels, every row count): tiles of
16 outputs; per tile and block, Q4_1: d[16], m[16] as float16, then 4 x 64 bytes (byte 4j + t of
vector h: weights 4h + t and 16 + 4h + t of output j as two nibbles); Q8_0: d[16] as float16, then
8 x 64 bytes (weight 4g + t of output j, plus 128).
Q4_0 (w = d (q - 8)) is stored as Q4_1 with m = -8 d, which rebuilds the same values exactly.

This module knows nothing about tokenizers, sampling or the engine.
"""

from __future__ import annotations

import numpy as np
import torch

G = 4  # output rows per group (qlinear.cpp)


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


TN = 16  # outputs per tile of the N-major layout (qlinear.cpp)


def _tile_scales(x: np.ndarray, T: int) -> np.ndarray:
    """Per-output, per-block scales [N, nb] as [T tiles, nb, 16 outputs * their bytes]."""
    return np.ascontiguousarray(x.reshape(T, TN, x.shape[1]).transpose(0, 2, 1)).view(np.uint8)


def _tile_scales16(x: np.ndarray, T: int) -> np.ndarray | None:
    """_tile_scales as float16 (2 bytes each: a GGUF file stores its scales so, and a block of the
    VNNI layout then reads 320 bytes instead of 384 (Q4_1), 544 instead of 576 (Q8_0)), or None if a
    scale is not a float16 value (its float32 would not come back exactly)."""
    h = x.astype(np.float16)
    return _tile_scales(h, T) if np.array_equal(h.astype(np.float32), x) else None


def _tiles(*parts: np.ndarray) -> torch.Tensor:
    """The tile layouts' bytes: per tile and block, the parts [T, nb, bytes] one after another."""
    return torch.from_numpy(np.ascontiguousarray(np.concatenate(parts, axis=2)).reshape(-1))


def _pack_q4_n(q, d, m) -> torch.Tensor | None:
    """The N-major layout: per tile of 16 outputs and block, d[16], m[16], q[16 weights][16 outputs]."""
    N, nb = d.shape
    if N % TN:
        return None
    T = N // TN
    qq = q.reshape(T, TN, nb, 16).transpose(0, 2, 3, 1).reshape(T, nb, 16 * TN)
    return _tiles(_tile_scales(d, T), _tile_scales(m, T), qq)


def _pack_q8_n(q, d) -> torch.Tensor | None:
    N, nb = d.shape
    if N % TN:
        return None
    T = N // TN
    qq = np.ascontiguousarray(q.reshape(T, TN, nb, 32).transpose(0, 2, 3, 1)).view(np.uint8).reshape(T, nb, 32 * TN)
    return _tiles(_tile_scales(d, T), qq)


def _pack_q4_v(q, d, m) -> torch.Tensor | None:
    """The VNNI layout: per tile of 16 outputs and block, d[16], m[16] as float16, then 4 x 64
    bytes; byte 4j + t of vector h: weight 4h + t of output j (low nibble) and weight 16 + 4h + t
    (high). None if the rows are not a multiple of 16 or a scale is not a float16 value."""
    N, nb = d.shape
    if N % TN:
        return None
    T = N // TN
    d16, m16 = _tile_scales16(d, T), _tile_scales16(m, T)
    if d16 is None or m16 is None:
        return None
    w = np.concatenate([q & 0x0F, q >> 4], axis=2).reshape(T, TN, nb, 2, 4, 4)  # [tile, j, b, half, h, t]
    qq = (w[:, :, :, 0] | (w[:, :, :, 1] << 4)).transpose(0, 2, 3, 1, 4).reshape(T, nb, 256)
    return _tiles(d16, m16, qq)


def _pack_q8_v(q, d) -> torch.Tensor | None:
    """The VNNI layout: per tile and block, d[16] as float16, then 8 x 64 bytes; byte 4j + t of
    vector g: weight 4g + t of output j, plus 128 (vpdpbusd multiplies unsigned by signed bytes).
    None if the rows are not a multiple of 16 or a scale is not a float16 value."""
    N, nb = d.shape
    if N % TN:
        return None
    T = N // TN
    d16 = _tile_scales16(d, T)
    if d16 is None:
        return None
    u = (q.astype(np.int16) + 128).astype(np.uint8).reshape(T, TN, nb, 8, 4)  # [tile, j, b, g, t]
    return _tiles(d16, u.transpose(0, 2, 3, 1, 4).reshape(T, nb, 512))


LAYOUTS = ("float", "vnni")  # for float32 activations (K- and N-major) | integer dot products
VNNI = "-vnni"  # suffix of a kind packed for the integer kernels ("Q4_1-vnni", "Q8_0-vnni")


def pack(kind: str, parts, layout: str = "float") -> tuple[str, torch.Tensor | None, torch.Tensor | None]:
    """(kind, first, second) packed bytes of decoded blocks (`parts` as _q4 / _q8 give them):
    layout "float": (kind, K-major, N-major or None); "vnni": (kind + "-vnni", VNNI layout, None),
    or (kind, None, None) if the matrix's rows are not a multiple of 16."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "vnni":
        v = _pack_q4_v(*parts) if kind == "Q4_1" else _pack_q8_v(*parts)
        return (kind + VNNI, v, None) if v is not None else (kind, None, None)
    if kind == "Q4_1":
        return kind, _pack_q4(*parts), _pack_q4_n(*parts)
    return kind, _pack_q8(*parts), _pack_q8_n(*parts)


def quantize_q8_0(w: torch.Tensor, layout: str = "float") -> tuple | None:
    """A drafter's own weight [N, K] as Q8_0 blocks (d = max |w| / 127 per 32 weights, rounded to
    float16 as GGUF stores it): (kind, first, second, rows) for attach (see pack), or None when K is
    not a multiple of 32 or N of 4 (of 16 for layout "vnni"). Lossy (~0.4% of a block's largest
    weight at most), which is fine for a drafter: exactness never depends on the drafter's numbers."""
    N, K = w.shape
    if K % 32 or N % (TN if layout == "vnni" else G):
        return None
    b = w.detach().float().reshape(N, K // 32, 32).numpy()
    d = (np.abs(b).max(axis=2) / 127.0).astype(np.float16).astype(np.float32)  # [N, nb]
    safe = np.where(d > 0, d, 1.0)
    q = np.clip(np.rint(b / safe[..., None]), -127, 127).astype(np.int8)
    return (*pack("Q8_0", (q, d), layout), N)
