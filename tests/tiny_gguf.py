"""Tiny Llama / Qwen2 GGUF files for tests, written with gguf.GGUFWriter.

`write_tiny_gguf(path, arch, ggml_type)` writes a 2-layer model (hidden 256, 4 query heads and 2
K/V heads of 64, feed-forward 512: every row a whole number of K-quant blocks) whose matrices are
random blocks of `ggml_type` (tests/gguf_random.py), norms and biases float32, and a tiny
byte-level BPE tokenizer (the 256 byte symbols, a few merges, three special tokens) with a chat
template in the metadata, as llama.cpp's converter writes them. Llama files hold q and k rows in
llama.cpp's interleaved order, as real ones do (the loader must undo it).

Mistral files are what llama.cpp writes for Mistral models: architecture "llama", a name that says
Mistral (transformers then builds its Mistral model), and a SentencePiece-style vocabulary
(`tokenizer="llama"`: <unk> <s> </s>, the 256 byte tokens, scored pieces; BOS added).
`rope_scaling` writes `{arch}.rope.scaling.*` keys (type, factor, original_context_length, ...),
`meta` any other `{arch}.*` key (a sliding window, attention temperature scaling).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from gguf_random import random_blocks

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 256, 4, 2, 64, 512, 2
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "r e", "a t"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_symbols() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]


def tokens() -> list[str]:
    """The vocabulary: byte symbols, merged pairs, special tokens."""
    return byte_symbols() + [m.replace(" ", "") for m in MERGES] + SPECIALS


SPM_PIECES = ["▁", "▁t", "he", "▁the", "in", "▁a", "er", "on", "▁s", "re"]


def spm_tokens() -> list[str]:
    """A SentencePiece-style vocabulary of the same size: <unk> <s> </s>, byte tokens, pieces."""
    return ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES


VOCAB = len(tokens())
EOS_ID = VOCAB - 1  # <|im_end|>
assert len(spm_tokens()) == VOCAB


def write_tiny_gguf(path: Path, arch: str = "llama", ggml_type: int = 8, seed: int = 0, layers: int = LAYERS,
                    head_type: int | None = None, rope_freqs=False, name: str | None = None,
                    tokenizer: str = "gpt2", rope_scaling: dict | None = None, extra_tensor: str | None = None,
                    untied: bool | None = None, context: int = 512, meta: dict | None = None,
                    head_dim: int = HEAD_DIM) -> Path:
    """Write the tiny model (module docstring); head_type: the LM head's type (default ggml_type);
    rope_freqs: add Llama 3.1's frequency-factor tensor (True: factors 1..8, or the factors given);
    name: general.name; tokenizer: "gpt2" (byte-level BPE) or "llama" (SentencePiece-style);
    rope_scaling: {key: value} written as {arch}.rope.scaling.{key}; extra_tensor: a float tensor of
    this name that no supported architecture reads; untied: write output.weight (default: qwen2);
    context: the context length; meta: {key: value} written as {arch}.{key} (e.g.
    "attention.sliding_window"); head_dim: the size of a head (other than hidden / heads: the
    attention key and value lengths are written, as for Mistral Nemo)."""
    from gguf import GGMLQuantizationType, GGUFWriter

    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), arch)
    w.add_name(name or f"tiny-{arch}")
    w.add_block_count(layers)
    w.add_context_length(context)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(head_dim)
    if head_dim * HEADS != HIDDEN:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(VOCAB)
    keys = {f"rope.scaling.{k}": v for k, v in (rope_scaling or {}).items()} | dict(meta or {})
    for key, value in keys.items():
        full = f"{arch}.{key}"
        if isinstance(value, str):
            w.add_string(full, value)
        elif isinstance(value, int):
            w.add_uint32(full, value)
        else:
            w.add_float32(full, float(value))
    if tokenizer == "llama":
        toks = spm_tokens()
        w.add_tokenizer_model("llama")
        w.add_token_list(toks)
        w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))])
        w.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES))
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(True)
    else:
        toks = tokens()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(toks)
        w.add_token_types([3 if t in SPECIALS else 1 for t in toks])
        w.add_token_merges(MERGES)
        w.add_bos_token_id(toks.index("<|im_start|>"))
        w.add_eos_token_id(EOS_ID)
        w.add_pad_token_id(toks.index("<|endoftext|>"))
        w.add_add_bos_token(False)
        w.add_chat_template(CHAT_TEMPLATE)

    def mat(name: str, n: int, k: int, t: int = ggml_type) -> None:
        w.add_tensor(name, random_blocks(t, n, k, rng), raw_dtype=GGMLQuantizationType(t))

    def vec(name: str, n: int, scale: float, center: float = 0.0) -> None:
        w.add_tensor(name, (center + scale * rng.standard_normal(n)).astype(np.float32))

    mat("token_embd.weight", VOCAB, HIDDEN)
    for i in range(layers):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", HIDDEN, 0.1, 1.0)
        vec(p + "ffn_norm.weight", HIDDEN, 0.1, 1.0)
        mat(p + "attn_q.weight", HEADS * head_dim, HIDDEN)
        mat(p + "attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        mat(p + "attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        if arch == "qwen2":
            vec(p + "attn_q.bias", HEADS * head_dim, 0.5)
            vec(p + "attn_k.bias", KV_HEADS * head_dim, 0.5)
            vec(p + "attn_v.bias", KV_HEADS * head_dim, 0.5)
        mat(p + "attn_output.weight", HIDDEN, HEADS * head_dim)
        mat(p + "ffn_gate.weight", FFN, HIDDEN)
        mat(p + "ffn_up.weight", FFN, HIDDEN)
        mat(p + "ffn_down.weight", HIDDEN, FFN)
    vec("output_norm.weight", HIDDEN, 0.1, 1.0)
    if arch == "qwen2" if untied is None else untied:
        mat("output.weight", VOCAB, HIDDEN, ggml_type if head_type is None else head_type)
    if rope_freqs is not False:
        factors = np.linspace(1.0, 8.0, head_dim // 2) if rope_freqs is True else rope_freqs
        w.add_tensor("rope_freqs.weight", np.asarray(factors, dtype=np.float32))
    if extra_tensor:
        vec(extra_tensor, HIDDEN, 0.1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


# the architectures whose q / k rows llama.cpp's converter permutes (LlamaModel.permute: rotary pairs of
# neighbours), Ministral 3's converter being a LlamaModel too
LLAMA_CPP_PERMUTED = ("llama", "mistral3")


def undo_llama_cpp_permute(w, n_head: int):
    """transformers' row order of a q or k matrix [rows, K] that llama.cpp's converter permuted
    (its reshape(n_head, 2, rows / n_head / 2, K).swapaxes(1, 2), undone)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def dequantized_state_dict(path: Path) -> dict:
    """A GGUF file's weights as a float32 state dict with transformers' names and row order
    (gguf.quants.dequantize of every tensor; llama.cpp's q/k rows of a Llama file put back): the
    fp32 copy the native model's GGUF path must compute like, for tests only; the row order undone
    here as llama.cpp's converter made it, not by specdec's code."""
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from specdec.models.gguf_file import GGUFFile

    gf = GGUFFile(path)
    cfg = gf.model_config()
    names = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
    per_layer = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                 "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}
    sd = {}
    for name, t in gf.tensors.items():
        base, kind = name.rsplit(".", 1)
        if base.startswith("blk."):
            _, i, part = base.split(".", 2)
            hf = f"model.layers.{i}.{per_layer[part]}"
        elif base in names:
            hf = names[base]
        else:
            continue
        w = dequantize(np.ascontiguousarray(gf.raw(name)), GGMLQuantizationType(t.type_id)).reshape(t.rows, -1)
        w = torch.from_numpy(np.array(w, dtype=np.float32)).reshape(-1) if t.rows == 1 else torch.from_numpy(
            np.array(w, dtype=np.float32))
        if gf.architecture in LLAMA_CPP_PERMUTED and base.endswith(("attn_q", "attn_k")):
            heads = cfg.num_attention_heads if base.endswith("attn_q") else cfg.num_key_value_heads
            w = undo_llama_cpp_permute(w, heads)
        sd[f"{hf}.{kind}"] = w
    return sd
