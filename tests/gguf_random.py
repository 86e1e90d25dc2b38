"""Random, valid GGUF tensor bytes of every type the kernels read, for tests and tiny model files.

`random_blocks(ggml_type, n_rows, k, rng)` returns the bytes of an [n_rows, k] tensor exactly as a
GGUF file stores it (each row k / block_size blocks, row-major): float16 scales of the size real
quantised models carry (so products stay in the range of a model's activations), uniformly random
quants, every value finite (checked against `gguf.quants.dequantize`). `TYPES` lists the type ids.
"""

from __future__ import annotations

import numpy as np
import torch

F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30
TYPES = (F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16)
NAMES = {F32: "F32", F16: "F16", Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0",
         Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K", BF16: "BF16"}
# ggml type id -> (weights per block, bytes per block), as gguf.constants.GGML_QUANT_SIZES has them
SIZES = {F32: (1, 4), F16: (1, 2), BF16: (1, 2), Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22),
         Q5_1: (32, 24), Q8_0: (32, 34), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}


def _f16(rng: np.random.Generator, n: int, lo: float, hi: float, sign: bool = False) -> np.ndarray:
    """n float16 values of magnitude in [lo, hi) (random signs if sign), as [n, 2] bytes."""
    v = rng.uniform(lo, hi, n)
    if sign:
        v *= rng.choice([-1.0, 1.0], n)
    return v.astype(np.float16).view(np.uint8).reshape(n, 2)


def _bytes(rng: np.random.Generator, n: int, width: int) -> np.ndarray:
    return rng.integers(0, 256, (n, width), dtype=np.uint8)


def _blocks(t: int, nb: int, rng: np.random.Generator) -> np.ndarray:
    """nb random blocks of type t, [nb, block bytes]."""
    if t == Q4_0:
        return np.concatenate([_f16(rng, nb, 0.002, 0.02), _bytes(rng, nb, 16)], axis=1)
    if t == Q4_1:
        return np.concatenate([_f16(rng, nb, 0.002, 0.02), _f16(rng, nb, 0.0, 0.15, sign=True),
                               _bytes(rng, nb, 16)], axis=1)
    if t == Q5_0:
        return np.concatenate([_f16(rng, nb, 0.001, 0.01), _bytes(rng, nb, 4), _bytes(rng, nb, 16)], axis=1)
    if t == Q5_1:
        return np.concatenate([_f16(rng, nb, 0.001, 0.01), _f16(rng, nb, 0.0, 0.15, sign=True),
                               _bytes(rng, nb, 4), _bytes(rng, nb, 16)], axis=1)
    if t == Q8_0:
        return np.concatenate([_f16(rng, nb, 0.0002, 0.002), _bytes(rng, nb, 32)], axis=1)
    if t in (Q4_K, Q5_K):  # d, dmin, 12 bytes of 6-bit scales and mins (any bytes are valid), [qh,] qs
        qh = [_bytes(rng, nb, 32)] if t == Q5_K else []
        return np.concatenate([_f16(rng, nb, 5e-5, 5e-4), _f16(rng, nb, 5e-5, 5e-4), _bytes(rng, nb, 12),
                               *qh, _bytes(rng, nb, 128)], axis=1)
    if t == Q6_K:  # ql, qh, 16 int8 scales, d
        return np.concatenate([_bytes(rng, nb, 128), _bytes(rng, nb, 64), _bytes(rng, nb, 16),
                               _f16(rng, nb, 1e-5, 1e-4)], axis=1)
    raise ValueError(f"no random blocks for ggml type {t}")


def random_blocks(ggml_type: int, n_rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """The bytes of a random [n_rows, k] tensor of ggml type `ggml_type`: uint8 [n_rows, row bytes]."""
    if ggml_type not in SIZES:
        raise ValueError(f"no random blocks for ggml type {ggml_type} (have {sorted(NAMES.values())})")
    bs, bb = SIZES[ggml_type]
    if k % bs:
        raise ValueError(f"{NAMES[ggml_type]} rows hold whole blocks of {bs}; k={k} is not a multiple")
    if ggml_type in (F32, F16, BF16):
        w = (rng.standard_normal((n_rows, k)) * 0.05).astype(np.float32)
        if ggml_type == F16:
            return w.astype(np.float16).view(np.uint8).reshape(n_rows, 2 * k)
        if ggml_type == BF16:  # the top half of each float32
            return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(n_rows, 2 * k)
        return w.view(np.uint8).reshape(n_rows, 4 * k)
    nb = n_rows * (k // bs)
    return np.ascontiguousarray(_blocks(ggml_type, nb, rng).reshape(n_rows, (k // bs) * bb))


def act8_rows(m: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Activations for the 8-bit path's tests: outliers (the per-slice scales matter), an all-zero
    256-slice in row 0, and rows of +-1 (q = +-127 in every slice)."""
    x = torch.randn(m, k, generator=g) * (0.05 + 8 * torch.rand(m, k, generator=g) ** 6)
    x[0, :256] = 0.0
    x[m // 2] = 1.0
    if m > 2:
        x[m - 1] = -1.0
    return x
