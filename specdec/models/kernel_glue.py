"""Glue between drafters and the kernels the target computes on (specdec/kernels).

A drafter's own numbers may move (Q8_0 copies of its weights, bfloat16 packing) without moving
the output: sampling draws from, and verification divides by, the q the drafter computes. So
where the target's decoding steps run on the row-stable kernels, a drafter (an EAGLE head, a
draft model) computes on the same kernels: a drafting step reads fewer bytes through calls with
a few microseconds of overhead. Both the drafters and the target's loader call these; nothing
here imports a drafter.
"""

from __future__ import annotations

import torch

from .llama import PACK_BATCH_HINT, cpu_has_bf16, mkldnn_packing_available


def bf16_drafting() -> bool:
    """Whether drafting heads pack their weights in bfloat16: where the CPU has bf16 units
    (AVX-512 BF16 or AMX), unless SPECDEC_DRAFT_FP32=1."""
    import os

    return os.environ.get("SPECDEC_DRAFT_FP32") != "1" and cpu_has_bf16()


def pack_drafting_head(W: torch.Tensor) -> tuple[torch.Tensor | None, torch.dtype | None]:
    """A drafter's output head W [S, D] prepacked for oneDNN: (packed weight, the dtype its input
    must be cast to), in bfloat16 where `bf16_drafting()` (drafting reads the head every step,
    right after the target's forward evicted it from the caches; exactness does not depend on
    it: sampling draws from, and verification divides by, the q these scores give), else fp32;
    (None, None) where packing is unavailable (then use W as it is)."""
    if not mkldnn_packing_available() or W.dtype != torch.float32 or W.device.type != "cpu":
        return None, None
    dtype = torch.bfloat16 if bf16_drafting() else torch.float32
    return torch.ops.mkldnn._reorder_linear_weight(W.to(dtype), PACK_BATCH_HINT), dtype


def drafting_act8(ops) -> bool:
    """Whether a drafter's Q8_0 copies take 8-bit activations (q8_0_linear_q8): where the target's
    GGUF products do (kernels.gguf_act8, the default) and the kernels have the op: a drafter's
    products run several times faster than on the float path (docs/benchmarks.md, "Drafters on
    8-bit activations"); only the drafter's numbers move."""
    from .. import kernels

    return kernels.gguf_act8() and hasattr(ops, "q8_0_linear_q8")


def rowstable_head(ops, W: torch.Tensor, q8: bool, saved=None) -> tuple:
    """(op, *args) computing h @ W^T (W [S, D], a drafter's output head) on the row-stable
    kernels `ops` as op(h, *args): over Q8_0 copies of W where `q8` (the target reads GGUF blocks)
    and W's shape allows them (on 8-bit activations where `drafting_act8`), else over the fp32 W.
    `saved`: where the copies are kept between runs (q8_0_copy)."""
    from .gguf_blocks import blocks_op

    blocks = q8_0_copy(W, saved, drafting_act8(ops)) if q8 else None
    return (ops.linear, W.contiguous()) if blocks is None else (blocks_op(ops, blocks[0]), blocks[1], blocks[2])


def q8_0_copy(w: torch.Tensor, saved=None, act8: bool = False) -> tuple | None:
    """gguf_blocks.quantize_q8_0(w, act8), kept at `saved` (a .npy path; None: not kept; the
    8-bit-activation layout under its own name): read back memory-mapped when a file of the right
    size is there, written when not. The copies of a drafter's weights take ~0.1 s of each start
    on the default model's EAGLE head; the caller's path names what they were made from
    (drafter_copies_dir)."""
    from .gguf_blocks import G, q8_0_kind, quantize_q8_0
    from .gguf_model import _read_saved, _write_saved

    N, K = w.shape
    if K % 32 or N % G:
        return None
    kind = q8_0_kind(N, act8)
    if saved is not None and kind == "Q8_0i8":
        saved = saved.with_name(f"{saved.stem}.i8{saved.suffix}")  # (both layouts take 36 bytes a block and row)
    blocks = _read_saved(saved)
    if blocks is not None and blocks.dtype == torch.uint8 and blocks.numel() == N * K // 32 * 36:  # (float16 d and a sum or float32 d; 32 int8)
        return kind, blocks, N
    copy = quantize_q8_0(w, act8)
    _write_saved(saved, copy[1])
    return copy


def rowstable_drafting(linears, W: torch.Tensor, target_model, saved=None):
    """Where the target's decoding steps run on the row-stable kernels (target_model.rowstable:
    a GGUF file's model, or models.llama.LlamaModel.use_rowstable), put a drafter's float32
    projections `linears` on those kernels, and return (op, *args) computing its output head
    W [S, D] on them (`rowstable_head`). Where the target reads a GGUF file's blocks (its head is
    on them), the drafter's weights become Q8_0 copies too where the shapes allow (a quarter of
    the bytes a drafting step reads); else they stay float32. None (nothing changed) where the
    target is not on these kernels. Only the drafter's own numbers move, so exactness does not depend on it. Call
    it before the projections are packed. `saved`: a folder where the Q8_0 copies are kept between
    runs (drafter_copies_dir; None: made at every start)."""
    ops = getattr(target_model, "rowstable", None)
    if ops is None or W.dtype != torch.float32:
        return None
    from .gguf_blocks import blocks_op

    on_blocks = target_model.head_rs_blocks is not None or getattr(target_model, "gguf_native", False)

    def kept(name: str):
        return None if saved is None else saved / f"{name}.npy"

    act8 = drafting_act8(ops)
    for i, lin in enumerate(linears):
        if lin.weight is None or lin.weight.dtype != torch.float32:
            continue
        blocks = q8_0_copy(lin.weight, kept(f"linear{i}"), act8) if on_blocks else None
        lin.rs = ops
        if blocks is not None:
            lin.rs_blocks = (blocks_op(ops, blocks[0]), blocks[1], blocks[2])
        else:
            lin.weight.data = lin.weight.data.contiguous()
    return rowstable_head(ops, W, on_blocks, kept("head"))


def draft_on_rowstable(model, head: torch.Tensor | None, target_model):
    """Where the target's decoding steps run on the row-stable kernels (target_model.rowstable),
    put an unpacked float32 native draft model's decoding steps on them too
    (LlamaModel.use_rowstable), over Q8_0 copies of its projections and LM head where the target
    reads GGUF blocks (its head is on them), over its fp32 weights otherwise; and return
    (op, *args) computing the subset head `head` [S, D] on them (None: no subset head, or nothing
    changed: see model.rowstable). Lossy for the draft's own numbers only, so exactness does not
    move."""
    from .gguf_blocks import quantize_q8_0

    ops = getattr(target_model, "rowstable", None)
    if ops is None or not getattr(model, "native", False) or model.dtype != torch.float32:
        return None
    on_blocks = target_model.head_rs_blocks is not None or getattr(target_model, "gguf_native", False)
    if getattr(model, "gguf_native", False) and model.rowstable is ops:
        pass  # a draft read from a GGUF file computes on these kernels from its own blocks already
    elif model.rowstable is None:
        if model.packed:
            return None
        blocks, act8 = {}, drafting_act8(ops)
        if on_blocks:
            for i, blk in enumerate(model.layers):
                for attr in ("wqkv", "wo", "w_gate_up", "w_down"):
                    b = quantize_q8_0(getattr(blk, attr).weight, act8)
                    if b is not None:
                        blocks[f"layers.{i}.{attr}"] = b
            if head is None and (b := quantize_q8_0(model.lm_head_weight(), act8)) is not None:
                blocks["head"] = b
        model.use_rowstable(ops, blocks)
    elif model.rowstable is not ops:
        return None
    return None if head is None else rowstable_head(ops, head, on_blocks)
