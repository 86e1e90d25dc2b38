"""The families beyond Llama's on the native model: Qwen3, Gemma 2, Gemma 3 and Phi-3.

What each adds to a Llama layer (the LlamaConfig fields that say so, computed by FamilyBlock):
  * qwen3: an RMS norm of every query and key head before the rotation (`qk_norm`), no q/k/v bias;
  * gemma2: embeddings times sqrt(hidden) (`embed_scale`); (1 + w) RMS norms, the 1 added to the
    weights at load (llama.cpp's GGUF files hold it added already); a norm after attention and
    after the MLP as well as before (`sandwich_norms`); a GELU-tanh gated MLP (`hidden_act`);
    scores scaled by query_pre_attn_scalar^-1/2 (`attn_scale`) and soft-capped, cap tanh(s / cap)
    (`attn_softcap`), logits too (`final_softcap`); every other layer attends within a sliding
    window (`sliding_window`, `sliding_layers`);
  * gemma3: Gemma 2's layer without the soft-capping, with Qwen3's q/k norms, five layers of six
    sliding, each kind with its own RoPE base (`local_rope_theta`: the sliding layers');
  * phi3: q/k/v and gate/up fused in the checkpoint (split at load from a folder; one GGUF tensor
    each, read as they lie), rotation of the first `rotary_dim` dimensions of a head only, and
    LongRoPE (its short factors and attention factor, the context cut to the original one).

A sliding window is computed, not cut: a token at position p attends to the keys at positions
above p - window, whether it is decoded alone, verified in a chain or as a tree node (its window
is its own position's: `window_mask`). Keys of the committed prefix sit at the slot of their
position; the new tokens' keys at the positions the forward is given. The cache keeps every
slot, so truncate and keep_paths are unchanged, and the numbers are the same ones however many
tokens a step verifies: the mask adds exact zeros and -inf, which the kernels' attention turns
into exact zeros.

Decoding steps (up to ATTEND_MAX_T new tokens a row, float32) run on the row-stable kernels:
norms (rms_norm, also per head), attention with the family's scale, cap and head size
(attend_scaled), the gate (silu_mul, gelu_tanh_mul) and the logits' cap (softcap); the rotation is
torch's elementwise products and sums, as in models/llama.py. Long prefills, which every method
shares, run on torch's ops.

This module knows nothing about files beyond the checkpoints' tensor names.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..types import SpecdecError
from .llama import ATTEND_MAX_T, Block, LlamaModel

# transformers' model types of these families (a Gemma 3 folder's text model is "gemma3_text")
FAMILY_TYPES = ("qwen3", "gemma2", "gemma3_text", "phi3")
GEMMA_TYPES = ("gemma2", "gemma3_text")
# the tokens that end a turn in each family's chat format, stop tokens wherever the vocabulary has
# them (as llama.cpp ends generation on them): Gemma's <end_of_turn>, Qwen's <|im_end|>, Phi's <|end|>
STOP_TEXTS = {"qwen3": ("<|im_end|>", "<|endoftext|>"), "gemma2": ("<end_of_turn>",),
              "gemma3_text": ("<end_of_turn>",), "phi3": ("<|end|>", "<|endoftext|>")}


def stop_ids(model_type: str, tokenizer) -> set[int]:
    """The ids of the family's end-of-turn tokens (STOP_TEXTS) that the tokenizer holds as single
    tokens (a chat model ends its answer with them, not with the end-of-text token)."""
    out = set()
    for text in STOP_TEXTS.get(model_type, ()) if tokenizer is not None else ():
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1:
            out.add(int(ids[0]))
    return out


def support_problem(hf) -> str | None:
    """None if the native model computes this family's config as transformers does, else what it
    does not compute."""
    mt = hf.model_type
    act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "silu")
    want = "gelu_pytorch_tanh" if mt in GEMMA_TYPES else "silu"
    if act != want:
        return f"activation {act!r} in a {mt} model"
    if getattr(hf, "use_bidirectional_attention", False):
        return "bidirectional attention (an embedding model)"
    if mt == "qwen3" and getattr(hf, "attention_bias", False):
        return "q/k/v/o biases in a qwen3 model"
    rope = _rope_dicts(hf)
    for kind, params in rope.items():
        rtype = params.get("rope_type", params.get("type", "default"))
        allowed = ("default", "longrope") if mt == "phi3" else ("default", "linear", "llama3", "yarn")
        if rtype not in allowed:
            return f"RoPE type {rtype!r}" + (f" ({kind} layers)" if len(rope) > 1 else "")
    return None


def _rope_dicts(hf) -> dict:
    """{layer kind: rope parameters}: Gemma 3 keeps one dict per kind of layer, others one."""
    rope = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    if "full_attention" in rope or "sliding_attention" in rope:
        return {k: dict(v or {}) for k, v in rope.items()}
    return {"full_attention": dict(rope)}


def config_from_hf(cls, hf):
    """The LlamaConfig (`cls`) of a Qwen3 / Gemma 2 / Gemma 3 / Phi-3 transformers config (or of
    the same attributes read from a GGUF file's metadata, gguf_file.model_config)."""
    mt = hf.model_type
    D, H, L = hf.hidden_size, hf.num_attention_heads, hf.num_hidden_layers
    head_dim = getattr(hf, "head_dim", None) or D // H
    rope = _rope_dicts(hf)
    full = rope["full_attention"]
    theta = float(full.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))
    full.setdefault("rope_type", full.get("type", "default"))
    full["rope_theta"] = theta
    max_pos = int(getattr(hf, "max_position_embeddings", 2048))
    window = int(getattr(hf, "sliding_window", None) or 0)
    types = getattr(hf, "layer_types", None)
    if mt == "phi3":  # (transformers' Phi-3 slides every layer when it has a window)
        types = ["sliding_attention"] * L
    sliding = tuple(t == "sliding_attention" for t in types) if window and types else ()
    if not any(sliding):
        window, sliding = 0, ()
    rotary = head_dim
    local_theta = 0.0
    if mt == "phi3":
        rotary = int(head_dim * float(full.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0))))
        if full["rope_type"] == "longrope":
            full, max_pos = _longrope(hf, full, rotary, max_pos), int(
                full.get("original_max_position_embeddings", getattr(hf, "original_max_position_embeddings", max_pos)))
    if "sliding_attention" in rope:  # (Gemma 3: the sliding layers rotate by their own base, unscaled)
        local = rope["sliding_attention"]
        if local.get("rope_type", local.get("type", "default")) != "default":
            raise SpecdecError(f"RoPE scaling of the sliding layers ({local}) is not supported")
        local_theta = float(local.get("rope_theta", 10000.0))
    gemma = mt in GEMMA_TYPES
    return cls(
        vocab_size=hf.vocab_size, hidden_size=D, intermediate_size=hf.intermediate_size, num_layers=L,
        num_heads=H, num_kv_heads=getattr(hf, "num_key_value_heads", None) or H, head_dim=head_dim,
        rms_norm_eps=hf.rms_norm_eps, rope_theta=theta, rope_parameters=full,
        tie_embeddings=bool(getattr(hf, "tie_word_embeddings", gemma)), max_position=max_pos, model_type=mt,
        qk_norm=mt in ("qwen3", "gemma3_text"), sandwich_norms=gemma, hidden_act="gelu_tanh" if gemma else "silu",
        embed_scale=math.sqrt(D) if gemma else 1.0,
        attn_scale=float(hf.query_pre_attn_scalar) ** -0.5 if gemma else 0.0,
        attn_softcap=float(getattr(hf, "attn_logit_softcapping", None) or 0.0) if gemma else 0.0,
        final_softcap=float(getattr(hf, "final_logit_softcapping", None) or 0.0) if gemma else 0.0,
        sliding_window=window, sliding_layers=sliding,
        local_rope_theta=local_theta,
        rotary_dim=rotary if rotary != head_dim else 0,
    )


def _longrope(hf, params: dict, rotary: int, max_pos: int) -> dict:
    """Phi-3's LongRoPE as transformers computes it for a context within the original one: the
    short factors, and the attention factor sqrt(1 + ln(max / original) / ln(original)) unless given."""
    orig = int(params.get("original_max_position_embeddings", getattr(hf, "original_max_position_embeddings",
                                                                       max_pos)))
    short = params.get("short_factor")
    if short is None or len(short) != rotary // 2:
        raise SpecdecError(f"LongRoPE needs {rotary // 2} short factors (rope_parameters.short_factor)")
    factor = params.get("factor") or max_pos / orig
    attn = params.get("attention_factor")
    if attn is None:
        attn = math.sqrt(1 + math.log(factor) / math.log(orig)) if factor > 1.0 else 1.0
    return {"rope_type": "longrope", "rope_theta": params["rope_theta"], "short_factor": [float(f) for f in short],
            "attention_factor": float(attn)}


def longrope_inv_freq(theta: float, dim: int, factors) -> torch.Tensor:
    """LongRoPE's frequencies, 1 / (factor * theta^(2i / dim)), in float32 as transformers computes them."""
    ext = torch.as_tensor(factors, dtype=torch.float32)
    return 1.0 / (ext * theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


# -- transformers' tensor names ------------------------------------------------------------------
def hf_layer_names(cfg) -> dict[str, tuple[str, ...]]:
    """FamilyBlock's weights -> the transformers tensors (under model.layers.N.) they are made of,
    concatenated along the outputs where there are several."""
    a, m = "self_attn.", "mlp."
    names = {"attn_norm": ("input_layernorm",), "wo": (a + "o_proj",), "w_down": (m + "down_proj",)}
    if cfg.model_type == "phi3":
        names.update(wqkv=(a + "qkv_proj",), w_gate_up=(m + "gate_up_proj",))
    else:
        names.update(wqkv=(a + "q_proj", a + "k_proj", a + "v_proj"), w_gate_up=(m + "gate_proj", m + "up_proj"))
    if cfg.sandwich_norms:  # (Gemma's post_attention_layernorm follows the attention; the MLP's comes before it)
        names.update(post_attn_norm=("post_attention_layernorm",), mlp_norm=("pre_feedforward_layernorm",),
                     post_mlp_norm=("post_feedforward_layernorm",))
    else:
        names["mlp_norm"] = ("post_attention_layernorm",)
    if cfg.qk_norm:
        names.update(q_norm=(a + "q_norm",), k_norm=(a + "k_norm",))
    return names


NORMS = ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm", "q_norm", "k_norm")


def load_hf_state_dict(model, sd) -> None:
    """A family's transformers weights into the native model `model` (LlamaModel of FamilyBlocks):
    Gemma's norm weights w as the 1 + w they multiply by."""
    c = model.cfg
    keys = {k[len("model."):] if k.startswith("model.") else k: k for k in sd.keys()}
    plus = 1.0 if c.model_type in GEMMA_TYPES else 0.0

    def take(name):
        if name not in keys:
            raise SpecdecError(f"weights are missing {name!r}; is this a {c.model_type} checkpoint?")
        return sd[keys[name]]

    layer_names = hf_layer_names(c)
    with torch.no_grad():
        model.embed.weight.copy_(take("embed_tokens.weight"))
        model.norm.copy_(take("norm.weight") + plus)
        if model.lm_head is not None:
            model.lm_head.weight.copy_(take("lm_head.weight" if "lm_head.weight" in keys else "embed_tokens.weight"))
        for i, blk in enumerate(model.layers):
            for slot, parts in layer_names.items():
                w = torch.cat([take(f"layers.{i}.{p}.weight") for p in parts])
                if slot in NORMS:
                    getattr(blk, slot).copy_(w + plus)
                else:
                    getattr(blk, slot).weight.copy_(w)


def llama_layer_state(cfg, weights: dict, i: int) -> dict[str, torch.Tensor]:
    """Layer i under a Llama layer's transformers names and meanings, from `weights` {FamilyBlock
    slot: float tensor} (norms as they multiply: Gemma's 1 + w): what training an EAGLE head
    initialised from a target layer reads (a head is a Llama layer)."""
    H, Hkv, Dh, I = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    p = f"model.layers.{i}."
    q, k, v = weights["wqkv"].split([H * Dh, Hkv * Dh, Hkv * Dh])
    gate, up = weights["w_gate_up"].split([I, I])
    return {p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v,
            p + "self_attn.o_proj.weight": weights["wo"], p + "mlp.gate_proj.weight": gate,
            p + "mlp.up_proj.weight": up, p + "mlp.down_proj.weight": weights["w_down"],
            p + "input_layernorm.weight": weights["attn_norm"],
            p + "post_attention_layernorm.weight": weights["mlp_norm"]}


def hf_llama_layer_state(cfg, sd, i: int) -> dict[str, torch.Tensor]:
    """llama_layer_state of layer i of a family's transformers weights `sd`."""
    keys = {k[len("model."):] if k.startswith("model.") else k: k for k in sd.keys()}
    plus = 1.0 if cfg.model_type in GEMMA_TYPES else 0.0
    weights = {}
    for slot, parts in hf_layer_names(cfg).items():
        w = torch.cat([sd[keys[f"layers.{i}.{p}.weight"]].float() for p in parts])
        weights[slot] = w + plus if slot in NORMS else w
    return llama_layer_state(cfg, weights, i)


# -- the layer -------------------------------------------------------------------------------------
# Decoding steps make the q/k norms, rotation, cache write and attention one kernel call
# (rope_attend_scaled); False makes them op by op (the same numbers; tests compare the two)
FUSED_STEP = True


def block(cfg, layer: int) -> Block:
    """The decoder layer `layer` of the native model: Block for Llama's families, FamilyBlock for these."""
    return FamilyBlock(cfg, layer) if cfg.model_type in FAMILY_TYPES else Block(cfg)


class FamilyBlock(Block):
    """A Qwen3 / Gemma / Phi-3 decoder layer (module docstring): Block's projections and norms, plus
    q/k norms, norms after attention and MLP, the family's attention scale, cap and window, partial
    rotation and GELU-tanh gating where the config says."""

    def __init__(self, cfg, layer: int) -> None:
        super().__init__(cfg)
        D, Dh = cfg.hidden_size, cfg.head_dim
        for name, size, on in (("q_norm", Dh, cfg.qk_norm), ("k_norm", Dh, cfg.qk_norm),
                               ("post_attn_norm", D, cfg.sandwich_norms), ("post_mlp_norm", D, cfg.sandwich_norms)):
            self.register_parameter(name, nn.Parameter(torch.ones(size)) if on else None)
        self.sliding = bool(cfg.sliding_layers and cfg.sliding_layers[layer])
        self.scale = cfg.attn_scale or Dh ** -0.5
        self.softcap = float(cfg.attn_softcap)
        self.gelu = cfg.hidden_act == "gelu_tanh"

    def fast_step_args(self):
        return None  # (Block's fused step is Llama's layer)

    def forward(self, x, cos, sin, cache, layer: int, start, uniform, mask, n_keys, causal=False, row_keys=None):
        B, T, D = x.shape
        H, Hkv, Dh = self.n_heads, self.n_kv, self.head_dim
        kops = self.kops
        adt = cache.k[layer].dtype
        # a decoding step (or a verification) on the kernels: every number as the token decoded alone gets it
        step = (kops is not None and not causal and T <= ATTEND_MAX_T and x.dtype == torch.float32
                and adt == torch.float32 and D % 8 == 0 and Dh % 8 == 0)
        eps = self.eps

        def norm(t, w):
            return kops.rms_norm(t, w, eps) if step else F.rms_norm(t, (t.shape[-1],), w, eps)

        qkv = self.wqkv.forward(norm(x, self.attn_norm))
        if step and FUSED_STEP:  # q/k norms, rotation, cache write and attention in one kernel call
            o = kops.rope_attend_scaled(qkv, self.q_norm, self.k_norm, eps, cos, sin, cache.k[layer], cache.v[layer],
                                        start, H, n_keys, mask, row_keys, self.scale, self.softcap)
            return self._finish(x, o, norm, step)
        qkv = qkv.view(B, T, H + 2 * Hkv, Dh)
        qk = qkv[:, :, : H + Hkv]
        if self.q_norm is not None:
            qk = torch.cat([norm(qk[:, :, :H], self.q_norm), norm(qk[:, :, H:], self.k_norm)], dim=2)
        R = cos.shape[-1]  # the rotated dimensions (all, unless partial: Phi-3)
        rot = qk if R == Dh else qk[..., :R]
        # rotate_half(x) * sin == roll(x, R/2) * (sin with its first half negated): same bits, fewer ops
        rot = rot * cos + rot.roll(R // 2, dims=-1) * sin
        qk = rot if R == Dh else torch.cat([rot, qk[..., R:]], dim=-1)
        q, k, v = qk[:, :, :H], qk[:, :, H:], qkv[:, :, H + Hkv:]
        cache.write(layer, k.transpose(1, 2), v.transpose(1, 2), start, uniform)
        if step:
            o = kops.attend_scaled(q, cache.k[layer], cache.v[layer], n_keys, mask, row_keys, self.scale, self.softcap)
        else:
            if causal and self.softcap:
                mask, causal = LlamaModel._mask(start, uniform, T, n_keys, None, H // Hkv, adt), False
            o = self._attend(q, cache.k[layer][:, :, :n_keys], cache.v[layer][:, :, :n_keys], mask, causal)
            o = o.transpose(1, 2).reshape(B, T, H * Dh).to(x.dtype)
        return self._finish(x, o, norm, step)

    def _finish(self, x, o, norm, step: bool):
        """The layer after its attention's output o [B, T, H * Dh]: the output projection, the MLP
        and their norms and residual sums."""
        kops = self.kops
        y = self.wo.forward(o)
        if self.post_attn_norm is not None:
            y = norm(y, self.post_attn_norm)
        x = x + y
        gu = self.w_gate_up.forward(norm(x, self.mlp_norm))
        if step:
            act = kops.gelu_tanh_mul(gu) if self.gelu else kops.silu_mul(gu)
        else:
            gate, up = gu.chunk(2, dim=-1)
            act = (F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up
        y = self.w_down.forward(act)
        if self.post_mlp_norm is not None:
            y = norm(y, self.post_mlp_norm)
        return x + y

    def _attend(self, q, keys, vals, mask, causal: bool):
        """torch's attention (long prefills): q [B, T, H, Dh] over keys, vals [B, Hkv, S, Dh], causal
        (a prefill from slot 0) or with the additive mask [B, 1, G * T, S] (None: every key), the G
        query heads of a K/V head folded into its rows; -> [B, H, T, Dh]."""
        B, T, H, Dh = q.shape
        Hkv = keys.shape[1]
        if causal:  # (no mask to read: SDPA skips the blocks above the diagonal)
            return F.scaled_dot_product_attention(q.transpose(1, 2).to(keys.dtype), keys, vals, is_causal=True,
                                                  scale=self.scale, enable_gqa=Hkv != H)
        qf = q.transpose(1, 2).reshape(B, Hkv, H // Hkv * T, Dh).to(keys.dtype)
        if not self.softcap:
            o = F.scaled_dot_product_attention(qf, keys, vals, attn_mask=mask, scale=self.scale)
        else:
            scores = torch.matmul(qf, keys.transpose(-1, -2)) * self.scale
            scores = torch.tanh(scores / self.softcap) * self.softcap
            if mask is not None:
                scores = scores + mask
            o = torch.matmul(torch.softmax(scores, dim=-1), vals)
        return o.view(B, H, T, Dh)


# -- the model around the layers -------------------------------------------------------------------
def sliding_inputs(model, positions, cos, sin, start, uniform, T: int, n_keys: int, attn_mask, groups: int, mask,
                   causal: bool, dtype):
    """(cos, sin, mask, causal) for the sliding-window layers of a forward: their own rotation where
    their RoPE base differs (Gemma 3), and `window_mask` once some key lies outside some query's window."""
    cfg = model.cfg
    if model.local_inv_freq is not None:
        cos, sin = model._rope(positions, model.local_inv_freq, 1.0)
    if int(positions.max()) < cfg.sliding_window:  # every key within every query's window
        return cos, sin, mask, causal
    return cos, sin, window_mask(model, positions, start, uniform, T, n_keys, attn_mask, groups, mask, dtype), False


def window_mask(model, positions, start, uniform, T: int, n_keys: int, attn_mask, groups: int, mask, dtype):
    """The additive mask [B, 1, groups * T, n_keys] of a sliding-window layer: the forward's mask
    (`mask`, else the one LlamaModel._mask builds: causal, a tree's, or none) with every key at
    position <= p - window hidden from the token at position p. A committed key's position is its
    slot; a new token's key has the position the forward gives it (a tree node: its depth), so a
    verified token sees exactly the window it sees decoded alone."""
    W = model.cfg.sliding_window
    base = mask if mask is not None else model._mask(start, uniform, T, n_keys, attn_mask, groups, dtype)
    B = positions.shape[0]
    if base is None:
        base = torch.zeros(B, 1, groups * T, n_keys, dtype=dtype, device=positions.device)
    slot = torch.arange(n_keys, device=positions.device)
    rel = slot[None, :] - start[:, None]  # [B, S]
    in_block = (rel >= 0) & (rel < T)
    key_pos = torch.where(in_block, torch.gather(positions, 1, rel.clamp(0, T - 1)), slot[None, :].expand_as(rel))
    outside = key_pos[:, None, :] <= positions[:, :, None] - W  # [B, T, S]
    return base.masked_fill(outside[:, None].repeat(1, 1, groups, 1), float("-inf"))


def cap_logits(model, logits: torch.Tensor) -> torch.Tensor:
    """cap tanh(logits / cap) where the model soft-caps its logits (Gemma 2), on the kernels where the
    model computes on them (each row's numbers its own), else torch's."""
    cap = model.cfg.final_softcap
    if not cap or logits is None:
        return logits
    if model.rowstable is not None and logits.dtype == torch.float32:
        return model.rowstable.softcap(logits, cap)
    return torch.tanh(logits / cap) * cap
