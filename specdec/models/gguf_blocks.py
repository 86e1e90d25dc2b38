"""A GGUF file's quantised weight blocks, packed for the block kernels (specdec/kernels).

A GGUF model is first dequantised to fp32 (loader.convert_gguf); that copy defines the model.
Its Q4_0 / Q4_1 / Q8_0 matrices can also be multiplied straight from their blocks: a decode step
then reads ~6 bits a weight instead of 32 (on this project's CPU that is most of a step's time).
This module turns the file's blocks into the kernels' layout for each of the native model's
projections (q/k/v and gate/up fused as the model fuses them; q and k rows permuted as
transformers' GGUF reader permutes them for Llama) and for the LM head, and *checks* that every
packed matrix rebuilds, weight for weight and bit for bit, the fp32 copy the model was loaded
from; a matrix that does not (another quantisation type, an unknown layout) is left to the fp32
path. The result is cached beside the fp32 copy (`blocks-v2.safetensors`, `blocks-vnni-v3.safetensors`).

Layouts (see qlinear.cpp): K-major, output rows in groups of 4; per group and 32-weight block,
Q4_1: d[4], m[4] as float32 then 4 x 16 nibble bytes; Q8_0: d[4] as float32 then 4 x 32 int8.
N-major, tiles of 16 outputs; per tile and block, Q4_1: d[16], m[16], then 16 x 16 bytes (weight
i of each output); Q8_0: d[16], then 32 x 16 int8. Both are kept: the kernels for 1-2 rows read
the first, those for 3-16 rows the second. VNNI (the integer kernels, every row count): tiles of
16 outputs; per tile and block, Q4_1: d[16], m[16] as float16, then 4 x 64 bytes (byte 4j + t of
vector h: weights 4h + t and 16 + 4h + t of output j as two nibbles); Q8_0: d[16] as float16, then
8 x 64 bytes (weight 4g + t of output j, plus 128). Each layout is cached in its own file
(BLOCKS_FILES).
Q4_0 (w = d (q - 8)) is stored as Q4_1 with m = -8 d, which rebuilds the same values exactly.

This module knows nothing about tokenizers, sampling or the engine.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

BLOCKS_FILES = {"float": "blocks-v2.safetensors", "vnni": "blocks-vnni-v3.safetensors"}
BLOCKS_FILE = BLOCKS_FILES["float"]
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


def _llama_row_order(n_rows: int, n_head: int) -> np.ndarray:
    """transformers' reverse permutation of q / k rows for Llama GGUF files, as row indices."""
    dim = n_rows // n_head // 2
    return np.arange(n_rows).reshape(n_head, dim, 2).swapaxes(2, 1).reshape(n_rows)


class _Source:
    """The file's tensors by name, each as (kind, decoded blocks) in transformers' row order."""

    def __init__(self, gguf_path: Path, cfg) -> None:
        from gguf import GGUFReader

        self.reader = GGUFReader(str(gguf_path))
        self.tensors = {t.name: t for t in self.reader.tensors}
        arch = self.reader.fields.get("general.architecture")
        self.arch = bytes(arch.parts[arch.data[0]]).decode() if arch is not None else ""
        self.cfg = cfg

    def get(self, name: str):
        t = self.tensors.get(name)
        if t is None:
            return None
        kind = t.tensor_type.name
        raw = np.asarray(t.data)
        if kind in ("Q4_0", "Q4_1"):
            q, d, m = _q4(raw, kind)
            parts = ("Q4_1", q, d, m)
        elif kind == "Q8_0":
            parts = ("Q8_0", *_q8(raw))
        else:
            return None
        if self.arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            heads = self.cfg.num_heads if ".attn_q." in name else self.cfg.num_kv_heads
            order = _llama_row_order(raw.shape[0], heads)
            parts = (parts[0], *(a[order] for a in parts[1:]))
        return parts


def _fuse(parts: list):
    """Stack matrices of one kind along the output rows (None if absent or of mixed kinds)."""
    if any(p is None for p in parts) or len({p[0] for p in parts}) != 1:
        return None
    return (parts[0][0], *(np.concatenate([p[i] for p in parts], axis=0) for i in range(1, len(parts[0]))))


def _matrices(src: _Source, n_layers: int, tied: bool):
    """(native name, HF weight names whose rows it stacks, decoded blocks)"""
    for i in range(n_layers):
        b = f"blk.{i}."
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        yield f"layers.{i}.wqkv", [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"], \
            _fuse([src.get(b + "attn_q.weight"), src.get(b + "attn_k.weight"), src.get(b + "attn_v.weight")])
        yield f"layers.{i}.wo", [a + "o_proj.weight"], src.get(b + "attn_output.weight")
        yield f"layers.{i}.w_gate_up", [m + "gate_proj.weight", m + "up_proj.weight"], \
            _fuse([src.get(b + "ffn_gate.weight"), src.get(b + "ffn_up.weight")])
        yield f"layers.{i}.w_down", [m + "down_proj.weight"], src.get(b + "ffn_down.weight")
    if tied or "output.weight" not in src.tensors:
        yield "head", ["model.embed_tokens.weight"], src.get("token_embd.weight")
    else:
        yield "head", ["lm_head.weight"], src.get("output.weight")


def build_blocks(gguf_path: Path, fp32_dir: Path, cfg, layout: str = "float") -> tuple[dict[str, tuple], list[str]]:
    """Pack every matrix of the file that rebuilds the fp32 copy in `fp32_dir` exactly, in
    `layout` (see pack). Returns ({native name: (kind, first, second or None, output rows)},
    notes on matrices left out)."""
    from safetensors import safe_open

    src = _Source(gguf_path, cfg)
    out, notes = {}, []
    files = sorted(fp32_dir.glob("*.safetensors"))
    handles = [safe_open(str(f), framework="pt") for f in files]

    def fp32(name):
        for h in handles:
            if name in h.keys():
                return h.get_tensor(name).numpy()
        return None

    for name, hf_names, parts in _matrices(src, cfg.num_layers, cfg.tie_embeddings):
        if parts is None:
            notes.append(f"{name}: not Q4_0/Q4_1/Q8_0 (or of mixed kinds)")
            continue
        ref = [fp32(n) for n in hf_names]
        if any(r is None for r in ref):
            notes.append(f"{name}: no fp32 copy to check against")
            continue
        ref = np.concatenate(ref, axis=0)
        kind = parts[0]
        w = _dequant_q4(*parts[1:]) if kind == "Q4_1" else _dequant_q8(*parts[1:])
        if w.shape != ref.shape or w.shape[0] % G or w.shape[1] % 32 or not np.array_equal(w, ref):
            notes.append(f"{name}: its blocks do not rebuild the fp32 weights exactly")
            continue
        kind, first, second = pack(kind, parts[1:], layout)
        if first is None:
            notes.append(f"{name}: {w.shape[0]} rows, not a multiple of {TN} (the VNNI kernels' tiles), or scales "
                         "that are not float16 values")
            continue
        out[name] = (kind, first, second, int(w.shape[0]))
    return out, notes


def load_blocks(gguf_path: Path, fp32_dir: Path, cfg, layout: str = "float") -> tuple[dict[str, tuple], list[str]]:
    """build_blocks, cached in fp32_dir (built and checked once per file and layout)."""
    from safetensors.torch import load_file, save_file

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    f = fp32_dir / BLOCKS_FILES[layout]
    if f.is_file():
        try:
            meta = json.loads(f.with_name(f.name + ".json").read_text())
            sd = load_file(str(f))
            return {k: (meta["kinds"][k], sd[k], sd.get(k + ".n"), int(meta["rows"][k])) for k in meta["kinds"]}, \
                meta["notes"]
        except (OSError, ValueError, KeyError):
            pass  # a damaged cache: build it again
    blocks, notes = build_blocks(gguf_path, fp32_dir, cfg, layout)
    tmp = f.with_name(f"{f.name}.{os.getpid()}.tmp")  # two processes may build it at once: each its own file
    tensors = {k: v[1] for k, v in blocks.items()}
    tensors.update({k + ".n": v[2] for k, v in blocks.items() if v[2] is not None})
    save_file(tensors, str(tmp))
    meta = f.with_name(f.name + ".json")
    meta_tmp = meta.with_name(f"{meta.name}.{os.getpid()}.tmp")
    meta_tmp.write_text(json.dumps(
        {"kinds": {k: v[0] for k, v in blocks.items()}, "rows": {k: v[3] for k, v in blocks.items()}, "notes": notes}))
    os.replace(meta_tmp, meta)
    os.replace(tmp, f)
    return blocks, notes
