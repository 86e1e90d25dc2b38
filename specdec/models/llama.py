"""Native Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) for speculative decoding; Qwen3,
Gemma 2 / 3 and Phi-3 add their layers' differences in models/families.py on the same model.

One implementation covers: grouped-query attention, optional q/k/v (and o) bias (Qwen2),
optional MLP bias, tied or untied embeddings, RoPE of type default / linear / llama3 /
yarn. The forward contract (docs/design.md):

    forward(tokens [B,T], positions [B,T], cache, attn_mask=None) -> (logits [B,T,V], hidden [B,T,D])

`attn_mask` [B,T,T] (bool, True = may attend) says which of the T new tokens see each
other: None is a causal chain; a tree passes its ancestor mask. Every new token always
sees its row's committed prefix in the cache. `hidden` is the final-normed hidden state
(what the LM head reads), used by Medusa/EAGLE-style drafters.

For speed the q/k/v projections and the gate/up projections are stored fused; the
loader maps Hugging Face parameter names onto them (`load_hf_state_dict`).

Verifying several tokens in one forward must give the logits that decoding them one at a
time gives, or greedy speculative output drifts from plain greedy output. Projections,
norms and rotations treat rows independently (the projections run one kernel for every
row count, see `packed_linear`), so only attention depends on how many tokens a forward
holds: its kernels split the keys and queries differently for different shapes. In float32
that changes logits by ~5e-5 (a near-tie could flip, rarely); in bfloat16 the roundings
after each op amplify it to ~0.5, and greedy text drifts within tens of tokens. So a
bfloat16 (or float16) model keeps its KV cache and attends in float64 (`attn_dtype`): the
shape-dependent differences then sit far below the model dtype's rounding, and a verified
token's logits equal one-at-a-time decoding's bit for bit (tested). A prefill from slot 0
(the same for every method) attends in float32.

A float32 model can compute its decoding steps (`step_call`: up to ATTEND_MAX_T new tokens a
row) on the row-stable kernels of specdec/kernels (`use_rowstable`; a GGUF file's model,
models/gguf_model.py, always does): projections (over the fp32 weights, or over Q4_1 / Q8_0 blocks
with the same numbers), RMS norms, rotation and attention whose every output is computed the same
way however many rows and tokens share the call, so there a verified token's logits equal
one-at-a-time decoding's bit for bit, in float32 too. Long prefills (the same for every method)
stay on oneDNN and SDPA.

This module knows nothing about files, tokenizers or sampling.
"""

from __future__ import annotations

import contextlib
import operator
import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..kv_cache import KVCache
from ..types import SpecdecError

NATIVE_MODEL_TYPES = ("llama", "mistral", "qwen2")
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_parameters: dict = field(default_factory=dict)
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    max_position: int = 2048
    model_type: str = "llama"
    # the families beyond Llama's (models/families.py): what their layers add
    qk_norm: bool = False  # an RMS norm of each query and key head before the rotation (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # norms after attention and after the MLP too (Gemma)
    hidden_act: str = "silu"  # the MLP's gate: "silu" or "gelu_tanh" (Gemma)
    embed_scale: float = 1.0  # embeddings times this (Gemma: sqrt(hidden))
    attn_scale: float = 0.0  # scores times this (Gemma: query_pre_attn_scalar^-1/2); 0: 1 / sqrt(head_dim)
    attn_softcap: float = 0.0  # scores soft-capped, cap tanh(s / cap) (Gemma 2); 0: none
    final_softcap: float = 0.0  # logits soft-capped likewise (Gemma 2); 0: none
    sliding_window: int = 0  # the window of the sliding layers (0: none)
    sliding_layers: tuple = ()  # per layer, whether it attends within sliding_window only
    local_rope_theta: float = 0.0  # the sliding layers' RoPE base where it differs (Gemma 3)
    rotary_dim: int = 0  # the dimensions of a head that rotate, where not all (Phi-3)

    @classmethod
    def from_hf(cls, hf) -> "LlamaConfig":
        """Build from a transformers PretrainedConfig (llama / mistral / qwen2; qwen3, gemma2,
        gemma3_text and phi3 through models/families.py)."""
        mt = getattr(hf, "model_type", "llama")
        from . import families

        if mt in families.FAMILY_TYPES:
            return families.config_from_hf(cls, hf)
        if mt not in NATIVE_MODEL_TYPES:
            raise SpecdecError(f"model type {mt!r} is not native (native: {', '.join(NATIVE_MODEL_TYPES)})")
        rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
        theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        rope.setdefault("rope_type", rope.get("type", "default"))
        rope["rope_theta"] = theta
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        max_pos = int(getattr(hf, "max_position_embeddings", 2048))
        # sliding-window attention only differs from full attention past the window, so
        # the native model is exact as long as the context stays inside it
        window = getattr(hf, "sliding_window", None)
        use_window = getattr(hf, "use_sliding_window", mt == "mistral")
        if window and use_window:
            max_pos = min(max_pos, int(window))
        if mt == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(getattr(hf, "attention_bias", False))
        return cls(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=theta,
            rope_parameters=rope,
            tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            max_position=max_pos,
            model_type=mt,
        )


def native_support_problem(hf_config) -> str | None:
    """None if the native model can run this config exactly, else the reason it cannot."""
    mt = getattr(hf_config, "model_type", None)
    from . import families

    if mt in families.FAMILY_TYPES:
        return families.support_problem(hf_config)
    if mt not in NATIVE_MODEL_TYPES:
        return f"model type {mt!r}"
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        return f"activation {act!r}"
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rtype = rope.get("rope_type", rope.get("type", "default"))
    if rtype not in STATIC_ROPE_TYPES:
        return f"RoPE type {rtype!r}"
    if getattr(hf_config, "pretraining_tp", 1) not in (1, None):
        return "pretraining_tp > 1"
    return None


def rope_inv_freq(cfg: LlamaConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2], attention scaling), matching transformers' rotary embedding."""
    rtype = cfg.rope_parameters.get("rope_type", "default")
    scaling = 1.0
    dim = cfg.rotary_dim or cfg.head_dim
    if rtype == "default":
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    elif rtype == "longrope":  # (Phi-3: its short factors, models/families.py)
        from .families import longrope_inv_freq

        inv_freq = longrope_inv_freq(cfg.rope_theta, dim, cfg.rope_parameters["short_factor"])
        scaling = cfg.rope_parameters["attention_factor"]
    else:
        from transformers import PretrainedConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        hf = PretrainedConfig(
            hidden_size=cfg.hidden_size,
            num_attention_heads=cfg.num_heads,
            head_dim=cfg.head_dim,
            max_position_embeddings=cfg.max_position,
        )
        hf.rope_parameters = dict(cfg.rope_parameters, partial_rotary_factor=dim / cfg.head_dim)
        hf.rope_theta = cfg.rope_theta
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rtype](hf, "cpu")
    return inv_freq.float(), float(scaling)


# oneDNN picks its blocking from this batch-size hint; measured on a 2-core EPYC at batch 1:
# hint 1 reads weights at 33 GB/s, hints 2-8 at 41 GB/s (the machine's streaming-read speed)
PACK_BATCH_HINT = 8


# oneDNN's kernels for prepacked weights are slowest at 1 and 2 rows: on this project's 2-core
# EPYC the 120 projections + LM head of the default model took 23.2 ms for one row and 27.0 ms
# for two, but 20.7 ms for four (the weights stream from memory either way; the kernel chosen
# for 3-6 rows streams them faster). So calls with fewer rows are padded to this many
# (rows >= 7 fall back to slower blocking again; they are not changed).
MIN_PACKED_ROWS = 4

# A float32 call of up to BLOCK_MAX_ROWS rows in all belongs to a decoding step (step_call),
# whatever its shape; so does one of up to ATTEND_MAX_T tokens a row. Up to BLOCK_MAX_ROWS rows, a
# step also takes the kernels' fused rotation + cache write + attention (Block.forward).
BLOCK_MAX_ROWS = 16

# Steps of up to this many new tokens attend through the kernels' attention where the layer has
# them (Block.kops): one fixed order of sums per query, so a verified token (chain or tree node)
# attends bit for bit as it does decoded alone. SDPA's sums differ in the last bits for different
# step sizes, so steps of 17+ tokens on SDPA could turn speculative greedy text away from plain
# decoding's on a near-tie (a 17-token step's logits differed by ~4e-3); so the kernel takes steps
# of up to 64 tokens (the CLI, the Engine and the batcher cap guesses at 48, types.MAX_GUESSES),
# exactness before the speed of such rare long steps. Longer non-causal calls (the chunks of a
# long prefill after its first) keep SDPA.
ATTEND_MAX_T = 64
ATTEND_HEAD_SIZES = (16, 32, 64, 128)  # what the attention kernel takes

# float32 chains longer than this (prefills) run in chunks of this many tokens, each through every
# layer before the next: the chunk's activations stay in the caches. A 1500 / 800-token prefill of
# the default model took 1798 -> 1604 ms / 786 -> 721 ms on this project's CPU (2 threads).
PREFILL_CHUNK = 512


# Decoding steps that the kernels' attention takes (and whose head size allows) run rotation, cache
# write and attention as one kernel call per layer (Block.forward); False takes the torch-op path
# with the kernels' attention instead (the same numbers; tests compare the two).
FUSED_DECODING_STEP = True
# Where a layer's four projections are all on the kernels' repacked blocks on 8-bit activations,
# that step is one `decode_layer` call (the same kernel calls, made from C++: the same numbers; the
# default model's plain decoding ~4% faster on a 2-core Xeon); False keeps the calls in Python.
DECODE_LAYER_OP = True

# ... and where every layer takes `decode_layer`, the step's layers are one `decode_layers` call (the
# same decode_layer calls, made in a loop in C++: the same numbers, one dispatch a step instead of one
# a layer); False keeps a call a layer.
DECODE_LAYERS_OP = True

_FAST = operator.attrgetter("fast")

# the kernels decode_layer makes a projection's call with (its `kinds`), by op name
_DECODE_LAYER_KINDS = {"q4_1_linear_q8": 0, "q8_0_linear_q8": 1, "kq_linear_q8": 2}


def decode_layer_args(fast: tuple | None, kops) -> tuple | None:
    """The arguments after the step's own (x, rotation, cache, start, heads, n_keys, mask,
    row_keys) of kops.decode_layer for a layer whose Block.fast is `fast`: its norms and eps, then
    per projection its kind and blocks (flattened: each projection's tensors with their types and
    row counts, how many it has, its K), then the q/k/v projection's bias or None (Qwen2's); None
    where another projection has a bias, one takes its outputs in another order or runs on
    another kernel (the Python calls then)."""
    if fast is None or kops is None or not hasattr(kops, "decode_layer"):
        return None
    kinds, packed, counts, types, Ns, Ks = [], [], [], [], [], []
    for p, (op, args, bias, order) in enumerate(fast[:4]):
        name = getattr(op, "__name__", "")
        if (bias is not None and p > 0) or order is not None or name not in _DECODE_LAYER_KINDS \
                or op is not getattr(kops, name):
            return None  # (a benchmark's other build of a kernel, too)
        kinds.append(_DECODE_LAYER_KINDS[name])
        if name == "kq_linear_q8":
            parts, part_types, part_ns, K = args
            packed += parts
            types += part_types
            Ns += part_ns
            counts.append(len(parts))
            Ks.append(K)
        else:
            blocks, n = args
            packed.append(blocks)
            types.append(0)
            Ns.append(n)
            counts.append(1)
            Ks.append(0)
    attn_norm, mlp_norm, eps = fast[4:]
    return attn_norm, mlp_norm, eps, kinds, packed, counts, types, Ns, Ks, fast[0][2]


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, kops=None) -> torch.Tensor:
    """RMS norm of x's rows; through the kernels `kops` (a few microseconds instead of ~10) for
    float32 rows of a width the kernel takes, where given: calls of up to BLOCK_MAX_ROWS rows, and
    every call of up to ATTEND_MAX_T tokens a row (x [B, T, D]: steps, and short prefills, which
    every method shares) however many rows, so that a token
    verified in a batch is normed by the same sums as decoded alone (torch's norm sums in another
    order: a batch verifying 5 guesses a row for 4 rows took it, and a near-tie could then turn
    batched speculative greedy text away from plain decoding's)."""
    D = x.shape[-1]
    if kops is not None and D % 16 == 0 and step_call(x):
        return kops.rms_norm(x, w, eps)
    return F.rms_norm(x, (D,), w, eps)


def step_call(x: torch.Tensor) -> bool:
    """Whether a float32 call belongs to a decoding step (or a short prefill, which every method
    shares) rather than to a long prefill: x [B, T, D] with up to ATTEND_MAX_T tokens a row, or up
    to BLOCK_MAX_ROWS rows in all. The row-stable kernels take exactly these calls (norms,
    projections, LM head), so a token verified among others and decoded alone meet the same code."""
    return x.dtype == torch.float32 and (
        x.numel() <= BLOCK_MAX_ROWS * x.shape[-1] or (x.dim() == 3 and x.shape[1] <= ATTEND_MAX_T))


_pad = threading.local()  # per thread (two models may run in two threads): {(width, dtype, device): buffer}


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., D] @ a oneDNN-prepacked weight (+ bias), rows padded to MIN_PACKED_ROWS.

    The padding rows live in one reused buffer per (thread, width, dtype, device); their
    outputs are dropped. A real row's result does not depend on the others (a matrix product
    treats rows independently), so padding changes only which kernel runs, i.e. the summation
    order (outputs within 3e-5 of the unpadded call on the default model's projections)."""
    D = x.shape[-1]
    rows = x.numel() // D if D else 0
    if rows >= MIN_PACKED_ROWS or rows == 0:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    bufs = getattr(_pad, "buffers", None)
    if bufs is None:
        bufs = _pad.buffers = {}
    key = (D, x.dtype, x.device)
    buf = bufs.get(key)
    if buf is None or buf.shape[0] < MIN_PACKED_ROWS:
        with torch.inference_mode(False):  # a normal tensor: written in and out of inference mode
            buf = bufs[key] = torch.zeros(MIN_PACKED_ROWS, D, dtype=x.dtype, device=x.device)
    buf[:rows].copy_(x.reshape(rows, D))
    y = torch.ops.mkldnn._linear_pointwise(buf, packed, bias, "none", [], "")
    return y[:rows].view(*x.shape[:-1], y.shape[-1])


_no_init = threading.local()  # .on: build modules without random init (build_native loads weights next)


@contextlib.contextmanager
def without_init():
    """Build modules inside without the random init of their Linear weights, where every weight is
    loaded right after (not via the meta device: its first use in a process costs ~0.5 s of lazy
    setup, a tenth of a CLI call's start-up)."""
    _no_init.on = True
    try:
        yield
    finally:
        _no_init.on = False


def mkldnn_packing_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN can prepack weights of this dtype here (bfloat16 needs AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT: on other CPUs a bf16 model computes with torch's plain products)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    ok = _packs.get(dtype)
    if ok is None:
        try:
            torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), PACK_BATCH_HINT)
            ok = True
        except RuntimeError:
            ok = False
        _packs[dtype] = ok
    return ok


_packs: dict = {}  # dtype -> whether oneDNN packs it on this CPU


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX-512 BF16 or AMX). There bf16 matrix
    products are 2.5-3x faster than fp32 when compute-bound (training a head) and read half the
    bytes when memory-bound (drafting)."""
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:
        return False


class Linear(nn.Linear):
    """nn.Linear that can swap its weight for a oneDNN-prepacked copy (`pack()`).

    On CPUs, torch's default fp32 matrix-vector path reads weights at about half the
    memory bandwidth that oneDNN's prepacked kernels reach, and batch-1 decoding is
    nothing but matrix-vector products; packing makes decode ~2x faster. Results differ
    from F.linear only by float summation order (~1e-6 relative). After packing, the
    plain weight is released (the packed copy is the only one).
    """

    packed: torch.Tensor | None = None
    packed_bias: torch.Tensor | None = None
    pack_dtype: torch.dtype | None = None
    # the row-stable float32 kernels (kernels.rowstable_ops(), LlamaModel.use_rowstable) for the
    # calls of decoding steps (step_call), over the plain weight (which then stays beside the packed
    # copy) or, where given, over the GGUF blocks rs_blocks (op, K-major blocks, rows): the same numbers
    rs = None
    rs_blocks: tuple | None = None

    def reset_parameters(self) -> None:
        if not getattr(_no_init, "on", False):  # (build_native overwrites every weight anyway)
            super().reset_parameters()

    def pack(self, dtype: torch.dtype | None = None) -> None:
        """dtype: pack the weight in this dtype (e.g. bfloat16 for a drafter, where half the
        bytes read matter more than the last bits); inputs are cast to it and outputs back."""
        w = self.weight.detach()
        if dtype is not None and dtype != w.dtype:
            w, self.pack_dtype = w.to(dtype), dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT)
        self.packed_bias = None if self.bias is None else self.bias.detach().to(w.dtype)
        if self.rs is not None:
            if self.rs_blocks is not None:
                self.weight = None  # (decoding steps read the blocks and the plain bias; long calls the packed copy)
            return  # (else decoding steps read the plain weight and bias)
        self.weight = None  # (the module's other code never reads it again)
        self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rs is not None and step_call(x):
            y = self.rs.linear(x, self.weight) if self.rs_blocks is None else self.rs_blocks[0](x, *self.rs_blocks[1:])
            return y if self.bias is None else y + self.bias
        if self.packed is not None:
            if self.pack_dtype is not None and x.dtype != self.pack_dtype:
                return packed_linear(x.to(self.pack_dtype), self.packed, self.packed_bias).to(x.dtype)
            return packed_linear(x, self.packed, self.packed_bias)
        return F.linear(x, self.weight, self.bias)


def additive_mask(allowed: torch.Tensor, groups: int, dtype=torch.float32) -> torch.Tensor:
    """allowed [B, T, S] (bool: token t may attend to slot s) -> the additive mask [B, 1, groups * T, S]
    the folded attention and the kernels' attention read (0 where allowed, -inf elsewhere; row
    g * T + t is token t for query head g)."""
    add = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
    return add[:, None].repeat(1, 1, groups, 1)


class Block(nn.Module):
    # the row-stable kernels (torch.ops.specdec_rs) for the layer's norms, rotation and attention in
    # decoding steps (LlamaModel.use_rowstable; a GGUF file's model sets it itself)
    kops = None
    # a decoding step's calls with every projection on the kernels' blocks or a GGUF file's bytes:
    # plain references to the kernels, blocks, biases and norm weights, so the step makes its kernel
    # calls without the Python of Linear.forward and nn.Module attribute lookups in between (the
    # same calls, so the same numbers; see fast_step_args)
    fast = None
    # (Block.fast it was made for, decode_layer_args of it): made at the first step after `fast` changes
    _decode_layer = None
    # a sliding-window layer (families.FamilyBlock sets it per layer); here so that the model's forward
    # reads it without nn.Module's __getattr__ raising and catching an AttributeError in every layer
    sliding = False

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        D, Dh = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, Dh
        self.eps = cfg.rms_norm_eps
        self.attn_norm = nn.Parameter(torch.ones(D))
        self.mlp_norm = nn.Parameter(torch.ones(D))
        self.wqkv = Linear(D, (cfg.num_heads + 2 * cfg.num_kv_heads) * Dh, bias=cfg.qkv_bias)
        self.wo = Linear(cfg.num_heads * Dh, D, bias=cfg.o_bias)
        self.w_gate_up = Linear(D, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.w_down = Linear(cfg.intermediate_size, D, bias=cfg.mlp_bias)

    # the model calls .forward directly, and so does this block for its projections: skipping the
    # module-call machinery (hooks) saved ~0.4 ms a forward of 30 layers on this project's CPU
    def forward(self, x, cos, sin, cache: KVCache, layer: int, start, uniform, mask, n_keys, causal=False,
                row_keys=None):
        """row_keys: None, or [B] the slots each row can see at most (its keys end where its new
        tokens do; the mask hides the rest): the row-stable kernels' attention then stops there
        instead of at n_keys, with the same result (see LlamaModel.forward)."""
        B, T, _ = x.shape
        rk = () if row_keys is None else (row_keys,)
        f = self.fast
        if (f is not None and FUSED_DECODING_STEP and not causal and T <= ATTEND_MAX_T
                and x.dtype == torch.float32 and cache.k[layer].dtype == torch.float32):
            # the fused decoding step below, its calls made straight (Block.fast); for any number of
            # rows, since the kernels take every row count with a row's numbers unchanged
            kops = self.kops
            if DECODE_LAYER_OP:
                made = self._decode_layer
                if made is None or made[0] is not f:
                    made = self._decode_layer = (f, decode_layer_args(f, kops))
                if made[1] is not None:
                    return kops.decode_layer(x, cos, sin, cache.k[layer], cache.v[layer], start, self.n_heads, n_keys,
                                             mask, row_keys, *made[1])
            (qkv_op, qkv_args, qkv_bias, qkv_order), (o_op, o_args, o_bias, _), (gu_op, gu_args, gu_bias, _), \
                (d_op, d_args, d_bias, _), an, mn, eps = f
            qkv = qkv_op(kops.rms_norm(x, an, eps), *qkv_args)
            if qkv_order is not None:
                qkv = qkv.index_select(-1, qkv_order)
            o = kops.rope_attend(qkv if qkv_bias is None else qkv + qkv_bias, cos, sin, cache.k[layer],
                                 cache.v[layer], start, self.n_heads, n_keys, mask, *rk)
            y = o_op(o, *o_args)
            x = x + (y if o_bias is None else y + o_bias)
            gu = gu_op(kops.rms_norm(x, mn, eps), *gu_args)
            y = d_op(kops.silu_mul(gu if gu_bias is None else gu + gu_bias), *d_args)
            return x + (y if d_bias is None else y + d_bias)
        H, Hkv, Dh = self.n_heads, self.n_kv, self.head_dim
        kops = self.kops
        h = rms_norm(x, self.attn_norm, self.eps, kops)
        # the kernels' attention: steps of up to ATTEND_MAX_T tokens of a float32 model
        kernel_attn = kops is not None and not causal and T <= ATTEND_MAX_T and Dh in ATTEND_HEAD_SIZES \
            and cache.k[layer].dtype == torch.float32
        if kernel_attn and FUSED_DECODING_STEP and Dh % 32 == 0 and B * T <= BLOCK_MAX_ROWS:
            # a decoding step through the kernels: rotation, cache write and attention in one call (the
            # numbers of the path below), whose attention gives a token verified among up to
            # ATTEND_MAX_T others the result it gets decoded alone, bit for bit (kernels/rowstable.cpp)
            o = kops.rope_attend(self.wqkv.forward(h), cos, sin, cache.k[layer], cache.v[layer], start, H, n_keys, mask,
                                 *rk)
            x = x + self.wo.forward(o)
            gu = self.w_gate_up.forward(rms_norm(x, self.mlp_norm, self.eps, kops))
            return x + self.w_down.forward(kops.silu_mul(gu))
        qkv = self.wqkv.forward(h).view(B, T, H + 2 * Hkv, Dh)
        qk = qkv[:, :, : H + Hkv]  # queries and keys rotate together: [B, T, H + Hkv, Dh]
        # rotate_half(x) * sin == roll(x, Dh/2) * (sin with its first half negated): same bits, fewer ops
        qk = qk * cos + qk.roll(Dh // 2, dims=-1) * sin  # cos, sin: [B, T, 1, Dh]
        q = qk[:, :, :H].transpose(1, 2)  # [B, H, T, Dh]
        k = qk[:, :, H:].transpose(1, 2)  # [B, Hkv, T, Dh]
        v = qkv[:, :, H + Hkv :].transpose(1, 2)
        adt = cache.k[layer].dtype  # the attention dtype (LlamaModel.attn_dtype)
        cache.write(layer, k, v, start, uniform)
        keys = cache.k[layer][:, :, :n_keys]  # [B, Hkv, S, Dh]
        vals = cache.v[layer][:, :, :n_keys]
        if kernel_attn:
            # the kernels' attention (kernels/rowstable.cpp): a token verified among up to ATTEND_MAX_T
            # others attends bit for bit as it does decoded alone
            o = kops.attend(q, cache.k[layer], cache.v[layer], n_keys, mask, *rk)
        elif causal and adt != x.dtype:
            # a prefill from slot 0 (the same for every method): float32 is enough, and fast
            o = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=Hkv != H)
        elif mask is None:
            # grouped-query attention without copying K/V per query head (enable_gqa)
            o = F.scaled_dot_product_attention(q.to(adt), keys, vals, is_causal=causal, enable_gqa=Hkv != H)
        else:
            # masked (a tree, a chain after a prefix, ragged rows): the G query heads that share
            # a K/V head become G*T query rows of one attention, with the additive mask already
            # repeated per head (see LlamaModel._mask): 10-35% less time than enable_gqa plus a
            # boolean mask, which SDPA converts in every layer
            G = H // Hkv
            o = F.scaled_dot_product_attention(q.reshape(B, Hkv, G * T, Dh).to(adt), keys, vals, attn_mask=mask)
            o = o.view(B, H, T, Dh)
        x = x + self.wo.forward(o.transpose(1, 2).reshape(B, T, H * Dh).to(x.dtype))
        h = rms_norm(x, self.mlp_norm, self.eps, kops)
        gate, up = self.w_gate_up.forward(h).chunk(2, dim=-1)
        return x + self.w_down.forward(F.silu(gate) * up)

    def fast_step_args(self) -> tuple | None:
        """Block.fast for this layer: per projection (qkv, o, gate/up, down) the kernel call a
        decoding step makes, (op, its arguments after x, the bias or None, the order its outputs
        are taken in or None: llama's q/k in a GGUF file), then the norm weights
        and eps; or None where the step needs the general path: a projection on neither the
        row-stable kernels' blocks nor a GGUF file's own kernels (`step_op`), or a norm width or
        head size the kernels do not take. (The same calls as the general path
        makes: the same numbers, without its Python.)"""
        lins = (self.wqkv, self.wo, self.w_gate_up, self.w_down)
        # the row-stable kernels' norms and attention (the AVX2 / VNNI build that also reads GGUF files)
        rs_shapes = self.kops is not None and self.attn_norm.shape[0] % 8 == 0 and self.head_dim in ATTEND_HEAD_SIZES
        if all(hasattr(lin, "step_op") for lin in lins):  # a GGUF file's tensors (gguf_model.GGUFLinear)
            calls = [lin.step_op() for lin in lins]
            if not rs_shapes or any(c is None for c in calls) or any(c[3] is not None for c in calls[1:]):
                return None
        elif self.kops is not None and all(lin.rs is self.kops for lin in lins):  # on Q4_1 / Q8_0 blocks
            if not (rs_shapes and all(lin.rs_blocks is not None and lin.bias is None for lin in lins)):
                return None
            calls = [(lin.rs_blocks[0], lin.rs_blocks[1:], None, None) for lin in lins]
        else:
            return None
        return (*calls, self.attn_norm.detach(), self.mlp_norm.detach(), self.eps)


class LlamaModel(nn.Module):
    """The native decoder. Build with `LlamaModel(cfg)` then `load_hf_state_dict(sd)`."""

    supports_tree = True
    native = True

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        if getattr(_no_init, "on", False):  # weights loaded next: skip the random init
            self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        else:
            self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        from .families import block

        self.layers = nn.ModuleList(block(cfg, i) for i in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = None if cfg.tie_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.head_packed: torch.Tensor | None = None
        # a plain attribute, not a buffer: model.to(bfloat16) must not round the frequencies
        with torch.device("cpu"):
            self.inv_freq, self.rope_scaling = rope_inv_freq(cfg)
            # the sliding layers' own rotation where their RoPE base differs (Gemma 3), and the
            # embeddings' scale (Gemma): plain attributes too, in float32
            self.local_inv_freq = None
            if cfg.local_rope_theta:
                from .families import default_inv_freq

                self.local_inv_freq = default_inv_freq(cfg.local_rope_theta, cfg.rotary_dim or cfg.head_dim)
            self.embed_scale = torch.tensor(cfg.embed_scale) if cfg.embed_scale != 1.0 else None

    # -- properties the engine and loaders read -------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def max_context(self) -> int:
        return self.cfg.max_position

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def attn_dtype(self) -> torch.dtype:
        """The KV cache's and attention's dtype: float64 for a bfloat16 / float16 model (so a
        verification forward's logits equal one-at-a-time decoding's; module docstring), else
        the model's."""
        return torch.float64 if self.dtype in (torch.bfloat16, torch.float16) else self.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def lm_head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def lm_head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the LM head [len(ids), D] (a GGUF model reads only these from its file)."""
        return self.lm_head_weight()[ids]

    def new_cache(self, batch_size: int, max_len: int | None = None) -> KVCache:
        max_len = min(max_len or self.max_context, self.max_context)
        c = self.cfg
        return KVCache(c.num_layers, batch_size, c.num_kv_heads, c.head_dim, max_len, self.attn_dtype, self.device)

    # -- forward ---------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        attn_mask: torch.Tensor | None = None,
        logits_at: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run T new tokens per row through the model, appending their K/V to `cache`.

        logits_at [B, M] (optional): indices into T for which to compute logits (the
        prefill needs only each row's last prompt token); the result is then [B, M, V].
        An empty logits_at ([B, 0]) skips the LM head and returns (None, hidden).
        """
        B, T = tokens.shape
        last = int(positions.max())
        if last >= self.cfg.max_position:
            raise SpecdecError(f"position {last} is past the model's context of {self.cfg.max_position} tokens")
        if T > PREFILL_CHUNK and attn_mask is None and self.dtype == torch.float32:
            # a long chain (a prefill) in chunks: each chunk's activations stay in the caches
            C, none = PREFILL_CHUNK, torch.empty(B, 0, dtype=torch.long)
            hidden = torch.cat([self.forward(tokens[:, a : a + C], positions[:, a : a + C], cache, logits_at=none)[1]
                                for a in range(0, T, C)], dim=1)
            return self._logits(hidden, logits_at), hidden
        start, uniform = cache.reserve(T)
        n_keys = int(cache.lengths.max())
        cos, sin = self._rope(positions, last=last)  # [B, T, 1, Dh]
        # a chain written from slot 0 in every row (a prefill) sees exactly the causal triangle:
        # SDPA's is_causal then skips the blocks above the diagonal instead of reading a mask
        # (the same bits; a 1500-token prefill's attention takes ~40% less time)
        causal = attn_mask is None and T > 1 and uniform == 0
        groups = self.cfg.num_heads // self.cfg.num_kv_heads
        mask = None if causal else self._mask(start, uniform, T, n_keys, attn_mask, groups, cache.k[0].dtype)
        # rows of different lengths: each row's keys end where its new tokens do (the mask hides
        # every slot after them: see _mask), so the row-stable kernels' attention stops there rather
        # than at the longest row's end. Same bits (hidden slots add exact zeros)
        row_keys = start + T if uniform is None and not causal and self.rowstable is not None else None
        kinds = {False: (cos, sin, mask, causal)}  # per kind of layer (sliding or not): rotation and mask
        if self.cfg.sliding_layers:
            from .families import sliding_inputs

            kinds[True] = sliding_inputs(self, positions, cos, sin, start, uniform, T, n_keys, attn_mask, groups, mask,
                                         causal, cache.k[0].dtype)
        x = self.embed(tokens)  # [B, T, D]
        if self.embed_scale is not None:  # (Gemma)
            x = x * self.embed_scale.to(x.dtype)
        stack = None if causal or T > ATTEND_MAX_T or x.dtype != torch.float32 else self._decode_stack(cache)
        if stack is not None:  # every layer a decode_layer: one call for all of them
            x = stack[0].decode_layers(x, cos, sin, cache.k, cache.v, start, self.cfg.num_heads, n_keys, mask,
                                       row_keys, *stack[1:])
            kops = stack[0]
        else:
            for i, layer in enumerate(self.layers):
                lcos, lsin, lmask, lcausal = kinds[getattr(layer, "sliding", False)]
                x = layer.forward(x, lcos, lsin, cache, i, start, uniform, lmask, n_keys, lcausal, row_keys)
            kops = self.layers[0].kops
        hidden = rms_norm(x, self.norm, self.cfg.rms_norm_eps, kops)  # [B, T, D]
        return self._logits(hidden, logits_at), hidden

    # (the layers' Block.fast it was made for, _make_stack's result): remade when a layer's `fast` changes
    _stack = None

    def _decode_stack(self, cache: KVCache) -> tuple | None:
        """(the kernels, then the arguments after the step's own of their decode_layers) where every
        layer is a plain Block whose step is one decode_layer call on float32 caches (Block.forward),
        else None: the layers' norms, eps, then their projections' kinds, tensors, counts, types, Ns
        and Ks and q/k/v biases, each list the layers' in turn."""
        if not (DECODE_LAYERS_OP and DECODE_LAYER_OP and FUSED_DECODING_STEP) or cache.k[0].dtype != torch.float32:
            return None
        fasts = tuple(map(_FAST, self.layers))
        made = self._stack
        if made is None or len(made[0]) != len(fasts) or not all(map(operator.is_, made[0], fasts)):
            made = self._stack = (fasts, self._make_stack())
        return made[1]

    def _make_stack(self) -> tuple | None:
        """What _decode_stack returns, from the layers as they are now."""
        kops = self.layers[0].kops
        if kops is None or not hasattr(kops, "decode_layers") or self.cfg.sliding_layers:
            return None
        attn, mlp, kinds, packed, counts, types, Ns, Ks, eps = [], [], [], [], [], [], [], [], None
        biases = []
        for layer in self.layers:
            if type(layer) is not Block or layer.kops is not kops:
                return None
            args = decode_layer_args(layer.fast, kops)
            if args is None or (eps is not None and args[2] != eps):
                return None
            an, mn, eps, k, p, c, t, n, kk, bias = args
            biases.append(bias)
            attn.append(an)
            mlp.append(mn)
            kinds += k
            packed += p
            counts += c
            types += t
            Ns += n
            Ks += kk
        if all(b is None for b in biases):
            biases = []
        elif any(b is None for b in biases):
            return None  # (q/k/v biases in some layers only: a call a layer)
        return kops, attn, mlp, eps, kinds, packed, counts, types, Ns, Ks, biases

    def _logits(self, hidden: torch.Tensor, logits_at: torch.Tensor | None) -> torch.Tensor | None:
        """The LM head over hidden [B, T, D] at logits_at (all positions if None; none if empty:
        the caller applies its own head, e.g. a vocabulary subset)."""
        if logits_at is not None and logits_at.shape[1] == 0:
            return None
        h = hidden
        if logits_at is not None:
            idx = logits_at.to(torch.long)
            h = torch.gather(hidden, 1, idx[:, :, None].expand(-1, -1, hidden.shape[-1]))  # [B, M, D]
        if self.rowstable is not None and step_call(h):
            hb = self.head_rs_blocks
            logits = self.rowstable.linear(h, self.lm_head_weight()) if hb is None else hb[0](h, *hb[1:])
        elif self.head_packed is not None:
            logits = packed_linear(h, self.head_packed)
        else:
            logits = F.linear(h, self.lm_head_weight())
        if self.cfg.final_softcap:  # (Gemma 2)
            from .families import cap_logits

            logits = cap_logits(self, logits)
        return logits

    def pack(self) -> "LlamaModel":
        """Prepack every projection and the LM head for oneDNN (inference only; see Linear)."""
        if not mkldnn_packing_available(self.dtype) or self.device.type != "cpu" or self.packed:
            return self
        for blk in self.layers:
            for lin in (blk.wqkv, blk.wo, blk.w_gate_up, blk.w_down):
                lin.pack()
        # the head keeps its plain weight too: drafters read it (vocabulary subsets, EAGLE)
        self.head_packed = torch.ops.mkldnn._reorder_linear_weight(self.lm_head_weight().detach(), PACK_BATCH_HINT)
        self._packed = True
        return self

    _packed = False

    @property
    def packed(self) -> bool:
        """Whether pack() has run (the model is ready for inference on a CPU)."""
        return self._packed

    rowstable = None  # the row-stable float32 kernels, where use_rowstable attached them
    head_rs_blocks = None  # (op, K-major blocks, rows) of the LM head on them, if any

    def use_rowstable(self, ops, blocks: dict | None = None) -> int:
        """Compute decoding steps (step_call: up to ATTEND_MAX_T tokens a row) with the row-stable
        float32 kernels `ops` (kernels.rowstable_ops()): projections, LM head, norms, rotation and
        attention, each token's numbers the same whether it is decoded alone or verified among
        others, so speculative greedy text equals plain greedy text bit for bit. Long prefills stay
        on oneDNN (the same for every method). For a float32 native model (a Hugging Face
        folder's, a draft's). blocks: {name ("layers.3.wqkv" | "head"): (kind, K-major blocks,
        rows)} as gguf_blocks packs them: those matrices are read from their Q4_1 / Q8_0 blocks
        (a drafter's Q8_0 copies: quantize_q8_0), ~5x fewer bytes a step. Call before pack(),
        which then keeps the plain weight of each projection not on blocks beside its packed
        copy. Returns how many matrices were put on blocks."""
        if self.dtype != torch.float32:
            raise SpecdecError("the row-stable kernels compute in float32 only")
        if self.packed:
            raise SpecdecError("use_rowstable must come before pack() (packing releases the plain weights)")
        for blk in self.layers:
            for lin in (blk.wqkv, blk.wo, blk.w_gate_up, blk.w_down):
                lin.rs = ops
                lin.weight.data = lin.weight.data.contiguous()
            blk.kops = ops
            blk.fast = None
        from .gguf_blocks import blocks_op

        n = 0
        for name, (kind, first, rows) in (blocks or {}).items():
            op = blocks_op(ops, kind)
            if op is None:
                raise SpecdecError(f"GGUF blocks of kind {kind!r}: the row-stable kernels read Q4_1 and Q8_0")
            if name == "head":
                if rows != self.cfg.vocab_size:
                    raise SpecdecError(f"GGUF blocks: the head has {rows} rows, the vocabulary {self.cfg.vocab_size}")
                self.head_rs_blocks = (op, first, rows)
            else:
                _, i, attr = name.split(".")
                lin = getattr(self.layers[int(i)], attr)
                if rows != lin.out_features:
                    raise SpecdecError(f"GGUF blocks with {rows} rows for a projection of {lin.out_features}")
                lin.rs_blocks = (op, first, rows)
            n += 1
        for blk in self.layers:
            blk.fast = blk.fast_step_args()  # (layers whose projections are all on blocks)
        self.rowstable = ops
        return n

    # (cos, sin [P, 1, rotated dims]) of the model's rotation at positions 0 .. P - 1 (_rope)
    _rope_table = None

    def _rope(self, positions: torch.Tensor, inv_freq=None, scaling=None,
              last: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin [B, T, 1, rotated dims]) at `positions`, of the model's rotation (or of inv_freq
        and scaling: a sliding layer's, models/families.py). The model's own are read from a table
        of every position so far (made by the same elementwise operations, so the same numbers: a
        step's ten small tensor operations were ~50 us of a 4 ms step), doubled as positions grow.
        last: the largest position, where the caller has it."""
        if inv_freq is None and scaling is None:
            table = self._rope_table
            if last is None:
                last = int(positions.max()) if positions.numel() else -1
            top = last + 1
            if table is None or table[0].shape[0] < top or table[0].device != positions.device \
                    or table[0].dtype != self.dtype:
                size = min(max(1024, 1 << max(top - 1, 1).bit_length()), max(self.cfg.max_position, top))
                cos, sin = self._rope(torch.arange(size, device=positions.device)[None], self.inv_freq,
                                      self.rope_scaling)
                table = self._rope_table = (cos[0], sin[0])
            return table[0][positions], table[1][positions]
        inv_freq = self.inv_freq if inv_freq is None else inv_freq
        scaling = self.rope_scaling if scaling is None else scaling
        freqs = positions[..., None].float() * inv_freq.to(positions.device)  # [B, T, Dh/2], fp32 as in transformers
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * scaling).to(self.dtype)[:, :, None]
        sin = (emb.sin() * scaling).to(self.dtype)[:, :, None]
        half = sin.shape[-1] // 2
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)  # signed for the roll form
        return cos, sin

    @staticmethod
    def _mask(start, uniform, T, n_keys, attn_mask, groups: int = 1, dtype=torch.float32):
        """Additive attention mask [B, 1, groups * T, S] (0 where a new token may attend, -inf
        elsewhere; rows repeated for the `groups` query heads per K/V head, the layout Block's
        folded attention uses), or None when no masking is needed."""
        if attn_mask is None and T == 1 and uniform is not None:
            return None  # one new token per row, all rows aligned: sees every key
        dev = start.device
        slot = torch.arange(n_keys, device=dev)  # [S]
        rel = slot[None, :] - start[:, None]  # [B, S]: key slot relative to the new block
        t = torch.arange(T, device=dev)
        if attn_mask is None:
            allowed = rel[:, None, :] <= t[None, :, None]  # causal: [B, T, S]
        else:
            in_block = (rel >= 0) & (rel < T)  # [B, S]
            rel_c = rel.clamp(0, T - 1)
            tree = torch.gather(attn_mask.to(torch.bool), 2, rel_c[:, None, :].expand(-1, T, -1))  # [B, T, S]
            allowed = (rel[:, None, :] < 0) | (in_block[:, None, :] & tree)
        return additive_mask(allowed, groups, dtype)

    # -- loading -----------------------------------------------------------------------
    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load transformers-style weights (model.layers.N.self_attn.q_proj.weight ...)."""
        c = self.cfg
        from . import families

        if c.model_type in families.FAMILY_TYPES:
            return families.load_hf_state_dict(self, sd)
        # names only: a lazy mapping (the loader's) then reads each tensor when it is copied in
        names = {k[len("model."):] if k.startswith("model.") else k: k for k in sd.keys()}

        def take(name):
            if name not in names:
                raise SpecdecError(f"weights are missing {name!r}; is this a {c.model_type} checkpoint?")
            return sd[names[name]]

        with torch.no_grad():
            self.embed.weight.copy_(take("embed_tokens.weight"))
            self.norm.copy_(take("norm.weight"))
            if self.lm_head is not None:
                self.lm_head.weight.copy_(take("lm_head.weight" if "lm_head.weight" in names else "embed_tokens.weight"))
            for i, blk in enumerate(self.layers):
                p = f"layers.{i}."
                blk.attn_norm.copy_(take(p + "input_layernorm.weight"))
                blk.mlp_norm.copy_(take(p + "post_attention_layernorm.weight"))
                a = p + "self_attn."
                blk.wqkv.weight.copy_(torch.cat([take(a + n + "_proj.weight") for n in "qkv"], 0))
                if c.qkv_bias:
                    blk.wqkv.bias.copy_(torch.cat([take(a + n + "_proj.bias") for n in "qkv"], 0))
                blk.wo.weight.copy_(take(a + "o_proj.weight"))
                if c.o_bias:
                    blk.wo.bias.copy_(take(a + "o_proj.bias"))
                m = p + "mlp."
                blk.w_gate_up.weight.copy_(torch.cat([take(m + "gate_proj.weight"), take(m + "up_proj.weight")], 0))
                blk.w_down.weight.copy_(take(m + "down_proj.weight"))
                if c.mlp_bias:
                    blk.w_gate_up.bias.copy_(torch.cat([take(m + "gate_proj.bias"), take(m + "up_proj.bias")], 0))
                    blk.w_down.bias.copy_(take(m + "down_proj.bias"))

    def num_parameters(self) -> int:
        """Parameter count from the config (packing releases the plain weights)."""
        c = self.cfg
        D, Dh, H, Hkv, I = c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads, c.intermediate_size
        per_layer = D * (H + 2 * Hkv) * Dh + H * Dh * D + 3 * D * I + 2 * D
        per_layer += (H + 2 * Hkv) * Dh * c.qkv_bias + D * c.o_bias + (2 * I + D) * c.mlp_bias
        per_layer += 2 * Dh * c.qk_norm + 2 * D * c.sandwich_norms
        head = 0 if c.tie_embeddings else c.vocab_size * D
        return c.num_layers * per_layer + D + c.vocab_size * D + head

    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decode step reads: everything but the embedding table,
        plus the LM head (which is the embedding table when tied)."""
        c = self.cfg
        untied_head = 0 if c.tie_embeddings else c.vocab_size * c.hidden_size
        n = self.num_parameters() - c.vocab_size * c.hidden_size - untied_head + c.vocab_size * c.hidden_size
        return n * self.embed.weight.element_size()


def build_native(hf_config, state_dict: dict[str, torch.Tensor], dtype=torch.float32, pack: bool = False) -> LlamaModel:
    """The native model with these weights; pack=True prepacks for fast CPU inference."""
    cfg = LlamaConfig.from_hf(hf_config)
    with without_init():  # (every parameter is overwritten below)
        model = LlamaModel(cfg)
    model.load_hf_state_dict(state_dict)
    model = model.to(dtype).eval()
    return model.pack() if pack else model

