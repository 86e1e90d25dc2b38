"""The native Llama-family model computing straight from a GGUF file's bytes.

Every projection and the LM head multiply through `gguf_linear` (torch.ops.specdec_rs, see
specdec/kernels) on the tensor's bytes exactly as the file stores them (a zero-copy view of its
memory map), and the embedding looks rows up through `gguf_rows`: no fp32 copy of the model is
made, in memory or on disk. The kernels compute a token's output the same way whatever the number
of rows in the call (decoding steps, verifications, prefills alike), so speculative greedy text
equals plain greedy text bit for bit, for every type the file holds. Norm weights and biases
(small, float) are tensors; q/k/v and gate/up stay separate calls on their own bytes.

llama.cpp stores a Llama (and Mistral, Ministral 3) model's q and k rows interleaved per head (its rotary pairs neighbours);
the native model rotates halves, as transformers does, so the q and k outputs are put back in
transformers' order by an index over the output columns (`llama_row_order`), not by copying rows.

Where the kernels cannot run (no AVX2/FMA, no compiler), a slow reference computes the same
contract from `gguf.quants.dequantize`d weights (kept in memory, one product a row, so still
row-stable); the loader says so in one line.

`check_sampled_rows` compares, on a few rows of every matrix, gguf_linear against
gguf.quants.dequantize and a float64 product, so a kernel that misreads a type fails the load
instead of producing text.
"""

from __future__ import annotations

import re

import numpy as np
import torch
from torch import nn

from ..types import SpecdecError
from .gguf_file import INTERLEAVED_QK, GGUFFile, TensorInfo
from .llama import LlamaConfig, LlamaModel, _no_init, step_call


def llama_row_order(n_rows: int, n_head: int) -> torch.Tensor:
    """Output column i of transformers' q (or k) projection is column order[i] of llama.cpp's."""
    dim = n_rows // n_head // 2
    return torch.arange(n_rows).reshape(n_head, dim, 2).transpose(1, 2).reshape(n_rows)


# -- a slow reference of the kernels' contract -------------------------------------------------
_dequantized: dict = {}  # id(raw bytes) -> (raw, float32 [N, K]); the reference keeps what it rebuilt


def dequantize(raw: torch.Tensor, ggml_type: int, K: int) -> np.ndarray:
    """gguf.quants.dequantize of raw bytes [n, row bytes] as float32 [n, K]."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as deq

    a = raw.numpy() if isinstance(raw, torch.Tensor) else raw
    return np.asarray(deq(np.ascontiguousarray(a), GGMLQuantizationType(ggml_type)), dtype=np.float32).reshape(-1, K)


def _reference_weight(raw: torch.Tensor, ggml_type: int, K: int) -> torch.Tensor:
    hit = _dequantized.get(id(raw))
    if hit is None or hit[0] is not raw:
        hit = _dequantized[id(raw)] = (raw, torch.from_numpy(dequantize(raw, ggml_type, K)))
    return hit[1]


def reference_linear(x: torch.Tensor, raw: torch.Tensor, ggml_type: int, N: int, K: int) -> torch.Tensor:
    """x [M, K] @ W^T with W rebuilt by gguf.quants.dequantize, one matrix-vector product a row
    (a row's sums never depend on M)."""
    W = _reference_weight(raw, ggml_type, K)
    if x.shape[0] == 0:
        return x.new_zeros(0, N)
    return torch.stack([torch.mv(W, x[i]) for i in range(x.shape[0])])


def reference_rows(raw: torch.Tensor, ggml_type: int, ids: torch.Tensor, K: int) -> torch.Tensor:
    return torch.from_numpy(dequantize(raw[ids], ggml_type, K))


class _LinearOp:
    """gguf_linear, carrying gguf_linear_cat as `.cat` (GGUFLinear takes several parts in one call)."""

    __slots__ = ("op", "cat")

    def __init__(self, op, cat) -> None:
        self.op, self.cat = op, cat

    def __call__(self, *args):
        return self.op(*args)


def kernel_ops(rowstable):
    """(gguf_linear, gguf_rows, True) of the row-stable kernels `rowstable` where they hold them,
    else the slow reference's (reference_linear, reference_rows, False)."""
    from .. import kernels

    if rowstable is not None and hasattr(rowstable, "gguf_linear") and hasattr(rowstable, "gguf_rows"):
        if kernels.gguf_act8() and hasattr(rowstable, "gguf_linear_cat_q8"):  # (K-quants: 8-bit activations)
            return _LinearOp(rowstable.gguf_linear_q8, rowstable.gguf_linear_cat_q8), rowstable.gguf_rows, True
        if hasattr(rowstable, "gguf_linear_cat"):
            return _LinearOp(rowstable.gguf_linear, rowstable.gguf_linear_cat), rowstable.gguf_rows, True
        return rowstable.gguf_linear, rowstable.gguf_rows, True
    return reference_linear, reference_rows, False


# -- modules -----------------------------------------------------------------------------------
class GGUFLinear(nn.Module):
    """x @ W^T (+ bias) with W one or more GGUF tensors stacked along the outputs (q, k, v; gate,
    up), each multiplied on its own bytes; `out_order` reorders the output columns (llama's q/k).
    Has the attributes models.llama's code asks a projection for (no packed or fp32 weights)."""

    rs = rs_blocks = packed = packed_bias = pack_dtype = None
    rs_every_call = False  # rs_blocks takes every call, not only decoding steps (repack_for_steps)
    weight = None

    def __init__(self, parts: list[tuple], op, bias: torch.Tensor | None = None,
                 out_order: torch.Tensor | None = None) -> None:
        super().__init__()
        self.parts = parts  # [(raw uint8 [N, row bytes], ggml type, N, K)]
        self.op = getattr(op, "op", op)  # (the bare kernel: no wrapper call in a step)
        self.in_features = parts[0][3]
        self.out_features = sum(p[2] for p in parts)
        self.bias = bias
        self.out_order = out_order
        # the kernels' gguf_linear_cat (the same numbers as one gguf_linear per part) where they have it
        self.op_cat = getattr(op, "cat", None)
        self.cat_args = None
        if self.op_cat is not None and len(parts) > 1:
            self.cat_args = ([p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts], self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rs_blocks is not None and (self.rs_every_call or step_call(x)):  # (see repack_for_steps)
            y = self.rs_blocks[0](x, *self.rs_blocks[1:])
            return y if self.bias is None else y + self.bias
        # the kernels with gguf_linear_cat take x [..., K] as it is and return [..., N]: no reshape and
        # view around the call (a decoding step makes 113 of them); others take x [M, K]
        native = self.op_cat is not None
        x2 = x if native else x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32:
            x2 = x2.float()
        if self.cat_args is not None:  # q, k, v (gate, up) in one kernel call, outputs side by side
            y = self.op_cat(x2, *self.cat_args)
        else:
            op = self.op
            ys = [op(x2, *p) for p in self.parts]
            y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        if self.out_order is not None:
            y = y.index_select(-1, self.out_order)
        if self.bias is not None:
            y = y + self.bias
        return y if native else y.view(*x.shape[:-1], self.out_features)

    def step_op(self) -> tuple | None:
        """(kernel, its arguments after x, bias or None, output order or None): the call `forward`
        makes for a decoding step, for Block.fast to make straight; None where its kernels take
        x [M, K] only."""
        if self.rs_blocks is not None:  # (repacked blocks hold llama's q/k rows reordered)
            return self.rs_blocks[0], self.rs_blocks[1:], self.bias, None
        if self.op_cat is None:
            return None
        if self.cat_args is not None:
            return self.op_cat, self.cat_args, self.bias, self.out_order
        return self.op, self.parts[0], self.bias, self.out_order

    def pack(self, dtype=None) -> None:  # nothing to pack: the kernels read the file's bytes
        return None

    @property
    def nbytes(self) -> int:
        return sum(p[0].numel() for p in self.parts)


class GGUFEmbedding(nn.Module):
    """Embedding rows looked up from the file's bytes (gguf_rows). `weight` (the whole table as
    float32) is built only when something asks for it: drafters that read the embedding or a tied
    LM head (EAGLE, Medusa, a vocabulary subset), never the model's own forward."""

    def __init__(self, raw: torch.Tensor, ggml_type: int, vocab: int, dim: int, rows_op) -> None:
        super().__init__()
        self.raw, self.ggml_type, self.num_embeddings, self.embedding_dim = raw, ggml_type, vocab, dim
        self.rows_op = rows_op
        self._weight = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        ids = tokens.reshape(-1).to(torch.long)
        return self.rows_op(self.raw, self.ggml_type, ids, self.embedding_dim).view(*tokens.shape, self.embedding_dim)

    @property
    def weight(self) -> torch.Tensor:
        if self._weight is None:
            self._weight = self.rows_op(self.raw, self.ggml_type, torch.arange(self.num_embeddings),
                                        self.embedding_dim)
        return self._weight


# FamilyBlock's norms beyond Llama's -> their tensors (blk.N.{name}); Gemma's hold 1 + w, as they multiply
FAMILY_NORMS = {"q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
                "post_attn_norm": "post_attention_norm.weight", "post_mlp_norm": "post_ffw_norm.weight"}
STEP_KINDS = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0"}  # what the AVX2 kernels' repacked step products read


def repack_for_steps(lin: GGUFLinear, kops, gf: GGUFFile, saved=None) -> bool:
    """A projection whose parts are all Q4_K / Q5_K / Q6_K: see _repack_k_for_steps. One whose parts are
    all Q4_0 / Q4_1 or all Q8_0 runs on its blocks repacked K-major
    (models/gguf_blocks; llama's q/k rows reordered there instead of the outputs). On 8-bit
    activations (kernels.gguf_act8, the default): q4_1_linear_q8 / q8_0_linear_q8 over groups of 16
    outputs, for every call (prefills too: one set of numbers), the rounded activations' product
    as gguf_linear_q8's but summed in another order, and a step of 8 tokens ~2x cheaper than on
    the float path. On the float path: its decoding steps on q4_1_linear / q8_0_linear over groups
    of 4, ~30% faster a step than gguf_linear on these types, and the same numbers (both equal the
    float product over the dequantised weights bit for bit; its other calls stay on gguf_linear).
    The file's pages of the repacked tensors are given back (madvise), so the
    model still holds about one copy of its bytes. `saved` (a .npy path) keeps the repacked blocks
    between runs: read back memory-mapped when it exists (a start then skips the repacking),
    written when it does not. Returns whether it did."""
    import zlib

    from .. import kernels
    from . import gguf_blocks as gb

    if kops is not None and all(p[1] in gb.KQ_TYPES for p in lin.parts):
        return _repack_k_for_steps(lin, kops, gf, saved)
    kinds = {STEP_KINDS.get(p[1]) for p in lin.parts}
    if kops is None or None in kinds or len({"Q8_0" in k for k in kinds}) != 1 or lin.in_features % 32 \
            or lin.out_features % gb.G:
        return False
    kind = "Q8_0" if "Q8_0" in kinds else "Q4_1"
    # 8-bit activations (the default, kernels.gguf_act8): groups of 16 rows for q4_1_linear_q8 /
    # q8_0_linear_q8, which then take every call (prefills too); else the float path's groups of 4
    act8 = kernels.gguf_act8() and hasattr(kops, "q4_1_linear_q8") and lin.out_features % gb.GI8 == 0
    if saved is not None:
        tag = "" if lin.out_order is None else f".{zlib.crc32(lin.out_order.numpy().tobytes()):08x}"
        saved = saved.with_name(f"{saved.stem}{tag}{'.i8' if act8 else ''}.npy")  # (the row order and layout packed)
    kmajor = _read_saved(saved)
    if kmajor is None:
        decoded = []
        for raw, t, _, _ in lin.parts:
            a = raw.numpy()
            decoded.append(gb._q8(a) if t == 8 else gb._q4(a, STEP_KINDS[t]))
        fused = tuple(np.concatenate([d[i] for d in decoded], axis=0) for i in range(len(decoded[0])))
        if lin.out_order is not None:
            fused = tuple(a[lin.out_order.numpy()] for a in fused)
        if act8:
            kmajor = gb.pack_q8_i8(*fused) if kind == "Q8_0" else gb.pack_q4_i8(*fused)
            if kmajor is None:  # (a scale that is not a float16: Q4_0's -8 d out of range)
                return False
        else:
            kmajor = gb._pack_q8(*fused) if kind == "Q8_0" else gb._pack_q4(*fused)  # (K-major: steps read no other)
        _write_saved(saved, kmajor)
    if act8:
        op = kops.q8_0_linear_q8 if kind == "Q8_0" else kops.q4_1_linear_q8
        lin.rs, lin.rs_blocks, lin.rs_every_call = kops, (op, kmajor, lin.out_features), True
    else:
        op = kops.q8_0_linear if kind == "Q8_0" else kops.q4_1_linear
        lin.rs, lin.rs_blocks = kops, (op, kmajor, lin.out_features)
        # long prefills on the float path too (not gguf_linear_q8's 8-bit activations): one set of numbers
        lin.op, lin.op_cat = kops.gguf_linear, kops.gguf_linear_cat
    for raw, *_ in lin.parts:  # (long prefills on the float path still read them: the pages come back then)
        gf.release(raw)
    return True


def _repack_k_for_steps(lin: GGUFLinear, kops, gf: GGUFFile, saved=None) -> bool:
    """repack_for_steps for a projection of Q4_K / Q5_K / Q6_K parts (q, k, v may mix them): on 8-bit
    activations (kernels.gguf_act8, the default), every call on kq_linear_q8 over each part's blocks
    repacked in groups of 16 outputs (gguf_blocks.pack_k_i8: Q6_K the file's size, Q4_K 2.8% more,
    Q5_K 2.3%);
    a step of several tokens then reads each weight block once and costs little more than one
    token (docs/benchmarks.md). The numbers are the rounded activations' product as
    gguf_linear_q8's, summed in another order. Not where a part's rows are not a multiple of 16,
    K of 256, or the output order (llama's q/k) moves rows between parts; nor on the float path,
    nor on the AVX2 build (one token dearer there).
    The file's pages of the repacked tensors are given back, as in repack_for_steps."""
    import zlib

    from .. import kernels
    from . import gguf_blocks as gb

    K = lin.in_features
    # AVX-512 VNNI builds only: the AVX2 build of kq_linear_q8 made a one-token step 1.2x dearer than
    # the file's own blocks (gguf_linear_q8) and an 8-token one only ~10% cheaper, so AVX2 machines
    # keep the file's blocks (and their numbers; speculative still equals plain on each machine)
    if not kernels.gguf_act8() or not hasattr(kops, "kq_linear_q8") or kernels.rowstable_isa() != "avx512vnni" \
            or K % 256 or any(p[2] % gb.GI8 for p in lin.parts):
        return False
    bounds = np.cumsum([0] + [p[2] for p in lin.parts])
    order = None if lin.out_order is None else lin.out_order.numpy()
    if order is not None and any(not np.all((order[a:e] >= a) & (order[a:e] < e)) for a, e in zip(bounds, bounds[1:])):
        return False
    if saved is not None:
        tag = "" if order is None else f".{zlib.crc32(order.tobytes()):08x}"
        saved = saved.with_name(f"{saved.stem}{tag}.k16.npy")  # (the row order and layout packed)
    sizes = [p[2] // gb.GI8 * (K // 256) * gb.KQ_BLOCK_BYTES[p[1]] for p in lin.parts]
    whole = _read_saved(saved)
    if whole is None or whole.numel() != sum(sizes):
        chunks = []
        for (raw, t, _, _), a, e in zip(lin.parts, bounds, bounds[1:]):
            rows = raw.numpy() if order is None else raw.numpy()[order[a:e] - a]
            chunks.append(gb.pack_k_i8(rows, t))
        whole = torch.cat(chunks)
        _write_saved(saved, whole)
    packed = list(torch.split(whole, sizes))
    lin.rs, lin.rs_every_call = kops, True
    lin.rs_blocks = (kops.kq_linear_q8, packed, [p[1] for p in lin.parts], [p[2] for p in lin.parts], K)
    for raw, *_ in lin.parts:
        gf.release(raw)
    return True


def _read_saved(path):
    """The repacked blocks saved at `path` (memory-mapped, copy-on-write), or None."""
    if path is None or not path.is_file():
        return None
    try:
        return torch.from_numpy(_map_npy(path))
    except (OSError, ValueError):
        return None  # (unreadable or cut short: repack instead, and write it again)


# the header np.save writes (version 1): dtype and shape
_NPY_HEADER = re.compile(rb"\{'descr': '([<>|]?[a-z]\d+)', 'fortran_order': False, 'shape': \(([\d, ]*)\), \} *\n")


def _map_npy(path) -> np.ndarray:
    """np.load(path, mmap_mode="c") for the version-1 .npy files _write_saved writes: the header
    read by a pattern instead of numpy's literal_eval and the file mapped without np.memmap's
    resolving of its path (together ~0.2 s of CPU at a start for the ~120 files of a model on a
    busy 2-core machine); any other header goes to np.load."""
    import mmap

    with open(path, "rb") as f:
        head = f.read(10)
        m = _NPY_HEADER.fullmatch(f.read(int.from_bytes(head[8:10], "little"))) \
            if head[:8] == b"\x93NUMPY\x01\x00" else None
        if m is None:
            return np.load(path, mmap_mode="c")
        shape = tuple(int(x) for x in m[2].split(b",") if x.strip())
        dtype = np.dtype(m[1].decode())
        count = int(np.prod(shape))
        if count == 0:
            return np.zeros(shape, dtype)
        start = f.tell()
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # (copy on write, as mode "c")
    return np.frombuffer(mm, dtype=dtype, count=count, offset=start).reshape(shape)


def _write_saved(path, blocks: torch.Tensor) -> None:
    """Save repacked blocks at `path` (atomically: a reader never sees half a file); an
    unwritable cache is no error, the next start repacks again."""
    if path is None:
        return
    import os

    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npy")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(tmp, blocks.numpy())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


class GGUFLlamaModel(LlamaModel):
    """LlamaModel whose projections, LM head and embedding read a GGUF file's bytes (module
    docstring); norms, rotation and attention of decoding steps run on the row-stable kernels
    `kops` (as LlamaModel.use_rowstable puts them), long prefills on torch's."""

    gguf_native = True

    def __init__(self, cfg: LlamaConfig, gf: GGUFFile, linear_op, rows_op, kops, repacked_dir=None) -> None:
        """repacked_dir: where repack_for_steps keeps this file's repacked blocks between runs
        (loader.repacked_dir; None: repack at every load)."""
        _no_init.on = True  # (the float weights LlamaModel makes are replaced below before any use)
        try:
            super().__init__(cfg)
        finally:
            _no_init.on = False
        self.gguf = gf
        permute = gf.architecture in INTERLEAVED_QK
        D, Dh, H, Hkv, I = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size

        def mat(name: str, n: int, k: int) -> tuple:
            t = self._tensor(name)
            if t.row_length != k or t.rows != n:
                raise SpecdecError(f"{gf.path.name}: tensor {name} is {t.rows} x {t.row_length}, the metadata says "
                                   f"{n} x {k}")
            return torch.from_numpy(gf.raw(name)), t.type_id, n, k

        def vec(name: str) -> torch.Tensor:
            self._tensor(name)
            return torch.from_numpy(gf.floats(name))

        order = None
        if permute:
            nq, nk = H * Dh, Hkv * Dh
            order = torch.cat([llama_row_order(nq, H), nq + llama_row_order(nk, Hkv), nq + nk + torch.arange(nk)])
        for i, blk in enumerate(self.layers):
            p = f"blk.{i}."
            blk.attn_norm = nn.Parameter(vec(p + "attn_norm.weight"), requires_grad=False)
            blk.mlp_norm = nn.Parameter(vec(p + "ffn_norm.weight"), requires_grad=False)
            bias = None
            if cfg.qkv_bias:
                bias = torch.cat([vec(p + f"attn_{n}.bias") for n in "qkv"])
                bias = bias if order is None else bias[order]
            fused = p + "attn_qkv.weight" in gf.tensors  # (Phi-3: q/k/v in one tensor, and gate/up)
            qkv = [mat(p + "attn_qkv.weight", (H + 2 * Hkv) * Dh, D)] if fused else [
                mat(p + "attn_q.weight", H * Dh, D), mat(p + "attn_k.weight", Hkv * Dh, D),
                mat(p + "attn_v.weight", Hkv * Dh, D)]
            blk.wqkv = GGUFLinear(qkv, linear_op, bias, order)
            blk.wo = GGUFLinear([mat(p + "attn_output.weight", D, H * Dh)], linear_op,
                                vec(p + "attn_output.bias") if cfg.o_bias else None)
            gate_up = [mat(p + "ffn_up.weight", 2 * I, D)] if cfg.model_type == "phi3" else [
                mat(p + "ffn_gate.weight", I, D), mat(p + "ffn_up.weight", I, D)]
            blk.w_gate_up = GGUFLinear(gate_up, linear_op)
            blk.w_down = GGUFLinear([mat(p + "ffn_down.weight", D, I)], linear_op)
            for slot, name in FAMILY_NORMS.items():  # (Qwen3's and Gemma's further norms, as the file holds them)
                if getattr(blk, slot, None) is not None:
                    setattr(blk, slot, nn.Parameter(vec(p + name), requires_grad=False))
            blk.kops = kops
        self.norm = nn.Parameter(vec("output_norm.weight"), requires_grad=False)
        embd = mat("token_embd.weight", cfg.vocab_size, D)
        self.embed = GGUFEmbedding(embd[0], embd[1], cfg.vocab_size, D, rows_op)
        self.lm_head = None
        self.head = GGUFLinear([mat("output.weight", cfg.vocab_size, D) if not cfg.tie_embeddings else embd],
                               linear_op)
        if "rope_freqs.weight" in gf.tensors:  # Llama 3.1's frequency factors (llama.cpp divides by them)
            factors = vec("rope_freqs.weight")
            if factors.numel() != self.inv_freq.numel():
                raise SpecdecError(f"{gf.path.name}: rope_freqs.weight has {factors.numel()} factors for "
                                   f"{self.inv_freq.numel()} frequencies")
            self.inv_freq = self.inv_freq / factors
        self.rowstable = kops
        self._head_weight = None
        if kops is not None and hasattr(kops, "q4_1_linear"):
            def saved(name: str):
                return None if repacked_dir is None else repacked_dir / f"{name}.npy"

            for i, blk in enumerate(self.layers):
                for attr in ("wqkv", "wo", "w_gate_up", "w_down"):
                    repack_for_steps(getattr(blk, attr), kops, gf, saved(f"blk.{i}.{attr}"))
            repack_for_steps(self.head, kops, gf, saved("output"))
        for blk in self.layers:  # the direct decoding-step calls, once the projections' kernels are settled
            blk.fast = blk.fast_step_args()

    def _tensor(self, name: str) -> TensorInfo:
        t = self.gguf.tensors.get(name)
        if t is None:
            raise SpecdecError(f"{self.gguf.path.name} has no tensor {name}; is it a complete "
                               f"{self.gguf.architecture} model?")
        return t

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def lm_head_weight(self) -> torch.Tensor:
        """The LM head as float32 [V, D], built on first request (drafters read it; the model's
        own logits come from the file's bytes)."""
        if self.cfg.tie_embeddings:
            return self.embed.weight
        if self._head_weight is None:
            self._head_weight = self.lm_head_rows(torch.arange(self.cfg.vocab_size))
        return self._head_weight

    def lm_head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the LM head as float32 [len(ids), D], read from the file's bytes: the numbers
        of lm_head_weight()[ids] without building the whole table (a drafter's vocabulary subset,
        the head's fingerprint)."""
        raw, ggml_type, _, dim = self.head.parts[0]
        return self.embed.rows_op(raw, ggml_type, ids.to(torch.long), dim)

    def _logits(self, hidden: torch.Tensor, logits_at: torch.Tensor | None) -> torch.Tensor | None:
        if logits_at is not None and logits_at.shape[1] == 0:
            return None
        h = hidden
        if logits_at is not None:
            idx = logits_at.to(torch.long)
            h = torch.gather(hidden, 1, idx[:, :, None].expand(-1, -1, hidden.shape[-1]))
        logits = self.head.forward(h)
        if self.cfg.final_softcap:  # (Gemma 2)
            from .families import cap_logits

            logits = cap_logits(self, logits)
        return logits

    def pack(self) -> "GGUFLlamaModel":
        self._packed = True  # nothing to pack: every product reads the file's bytes
        return self

    def use_rowstable(self, *args, **kwargs) -> int:
        raise SpecdecError("a model read from a GGUF file already computes on the row-stable kernels")

    def weight_bytes_per_token(self) -> int:
        """Bytes of the file a decode step reads: every projection's and the LM head's."""
        return self.head.nbytes + sum(lin.nbytes for blk in self.layers
                                      for lin in (blk.wqkv, blk.wo, blk.w_gate_up, blk.w_down))

    def hf_layer_state(self, i: int) -> dict[str, torch.Tensor]:
        """Layer i's weights dequantised to float32 (gguf.quants.dequantize) under a Llama layer's
        transformers names and row order (a family's layer as families.llama_layer_state reads it):
        what training a drafter initialised from a target layer reads (an EAGLE head); a copy of
        one layer, never the model."""
        from .families import llama_layer_state

        blk, weights = self.layers[i], {}
        for attr in ("wqkv", "wo", "w_gate_up", "w_down"):
            lin = getattr(blk, attr)
            w = torch.cat([torch.from_numpy(dequantize(raw, t, k)) for raw, t, _, k in lin.parts])
            weights[attr] = w if lin.out_order is None else w[lin.out_order]
        weights.update(attn_norm=blk.attn_norm.detach().clone(), mlp_norm=blk.mlp_norm.detach().clone())
        return llama_layer_state(self.cfg, weights, i)

    def matrices(self):
        """(name, raw bytes, ggml type, N, K) of every matrix the model multiplies by."""
        named = [("output" if not self.cfg.tie_embeddings else "token_embd", self.head)]
        for i, blk in enumerate(self.layers):
            named += [(f"blk.{i}.{a}", getattr(blk, a)) for a in ("wqkv", "wo", "w_gate_up", "w_down")]
        for name, lin in named:
            for j, p in enumerate(lin.parts):
                yield (f"{name}[{j}]" if len(lin.parts) > 1 else name), *p


def check_sampled_rows(model: GGUFLlamaModel, rows_per_matrix: int = 2, seed: int = 0) -> None:
    """On `rows_per_matrix` rows of every matrix (the first and random others) and a few embedding
    rows: gguf_linear / gguf_rows against gguf.quants.dequantize and a float64 product. Raises
    (one line, naming the tensor and type) where they part by more than float32 sums allow."""
    from .. import kernels
    from .gguf_file import GGML_TYPES

    g = torch.Generator().manual_seed(seed)
    for name, raw, t, n, k in model.matrices():
        rows = torch.unique(torch.cat([torch.zeros(1, dtype=torch.long), torch.randint(n, (rows_per_matrix - 1,),
                                                                                        generator=g)]))
        x = torch.randn(2, k, generator=g)
        sub = raw[rows].contiguous()
        W = dequantize(sub, t, k).astype(np.float64)  # [r, K]
        ref = x.double().numpy() @ W.T
        y = model.head.op(x, sub, t, len(rows), k).double().numpy()
        bound = 1e-5 * (np.abs(x.double().numpy()) @ np.abs(W).T) + 1e-30
        if t in kernels.ACT8_SLICE and model.head.op is getattr(model.rowstable, "gguf_linear_q8", None):
            bound = kernels.act8_error_bound(x.numpy(), W, t)  # (8-bit activations)
        if not np.isfinite(y).all() or (np.abs(y - ref) > bound).any():
            err = float(np.nanmax(np.abs(y - ref)))
            raise SpecdecError(f"the kernels misread tensor {name} ({GGML_TYPES[t][0]}): sampled rows differ from "
                               f"gguf.quants.dequantize's by {err:.3g}; rerun with SPECDEC_ROWSTABLE=0 to use the slow "
                               "reference, and report this")
    e = model.embed
    ids = torch.tensor([0, e.num_embeddings - 1])
    got = e.rows_op(e.raw, e.ggml_type, ids, e.embedding_dim).numpy()
    ref = dequantize(e.raw[ids], e.ggml_type, e.embedding_dim)
    if not (np.abs(got - ref) <= 1e-6 * np.abs(ref).max(axis=1, keepdims=True)).all():
        raise SpecdecError(f"the kernels misread the embedding token_embd.weight ({GGML_TYPES[e.ggml_type][0]})")
