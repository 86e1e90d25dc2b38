"""Tiny random transformers models (the oracle) and their native twins, and what the tests of the
native model's forward share: masks, ragged prefills, kernels, bit-for-bit step comparisons.

Every tiny model is fp32, built under a fixed seed, with *all* parameters re-drawn at
random (transformers initialises biases to 0 and norms to 1, which would hide a weight
that is loaded into the wrong place). The scale is chosen so logits are O(1): a wrong
weight then moves them by far more than the 1e-4 tolerance.
"""

from __future__ import annotations

import functools

import pytest
import torch

TOL = 1e-4  # max abs logit difference, fp32

LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)
LINEAR_ROPE = dict(rope_type="linear", rope_theta=10000.0, factor=4.0)

FAMILIES = ("llama", "llama_tied", "llama3_rope", "linear_rope", "qwen2", "mistral")

COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query attention
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)


def hf_config(family: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    if family == "llama":
        return LlamaConfig(**COMMON, tie_word_embeddings=False)
    if family == "llama_tied":
        return LlamaConfig(**COMMON, tie_word_embeddings=True)
    if family == "llama3_rope":
        return LlamaConfig(**COMMON, tie_word_embeddings=False, rope_parameters=dict(LLAMA3_ROPE))
    if family == "linear_rope":
        return LlamaConfig(**COMMON, tie_word_embeddings=False, rope_parameters=dict(LINEAR_ROPE))
    if family == "qwen2":
        return Qwen2Config(**COMMON, tie_word_embeddings=False, use_sliding_window=False)
    if family == "mistral":
        return MistralConfig(**COMMON, tie_word_embeddings=False, sliding_window=None)
    raise KeyError(family)


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Re-draw every parameter: norms around 1, biases and weights non-zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ".ln_" in name or name.startswith("ln_"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif "embed" in name or "wte" in name or "wpe" in name:
                p.copy_(0.25 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 1
                p.copy_(torch.randn(p.shape, generator=g) / fan_in**0.5)
    return model


def build_hf(family: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = hf_config(family)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    randomize_(hf, seed)
    if cfg.tie_word_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    return hf.eval()


class Pair:
    """A transformers model (the oracle) and the native model built from its weights."""

    def __init__(self, family: str, hf, native) -> None:
        self.family, self.hf, self.native = family, hf, native

    @torch.no_grad()
    def ref_logits(self, tokens, positions=None) -> torch.Tensor:
        """transformers' logits [B, T, V] for a full sequence from scratch (no cache)."""
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        if tokens.dim() == 1:
            tokens = tokens[None]
        if positions is None:
            positions = torch.arange(tokens.shape[1])[None].expand_as(tokens)
        return self.hf(input_ids=tokens, position_ids=positions, use_cache=False).logits.float()


_PAIRS: dict[str, Pair] = {}


def get_pair(family: str) -> Pair:
    if family not in _PAIRS:
        from specdec.models.llama import build_native

        hf = build_hf(family)
        native = build_native(hf.config, hf.state_dict())
        _PAIRS[family] = Pair(family, hf, native)
    return _PAIRS[family]


def random_tokens(n: int, vocab: int = 97, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


def assert_act8_close(got: torch.Tensor, want: torch.Tensor, max_kl: float = 0.05, min_agree: float = 0.65) -> None:
    """got [T, V]: logits computed on 8-bit activations (kernels.gguf_act8), want: the same
    positions' logits of the float products (or a float computation that the rounding of
    activations amplifies: a long prefill). Each activation's rounding moves a product by up to half
    its slice's step, which 30 layers carry to the logits (~0.5-1.7 at most on the default model,
    mean KL ~0.004 nats, top-1 the same at ~98% of positions over Spec-Bench dev prompts): so the
    bound is a mean KL(want || got) of at most max_kl and the same argmax on at least min_agree of
    the positions. Wrong weights or a misread layout give KLs of whole nats."""
    lw, lg = torch.log_softmax(want.double(), -1), torch.log_softmax(got.double(), -1)
    kl = float((lw.exp() * (lw - lg)).sum(-1).mean())
    agree = float((got.argmax(-1) == want.argmax(-1)).double().mean())
    assert kl <= max_kl and agree >= min_agree, (kl, agree)


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[N, N] bool: node i may attend node j iff j is i or an ancestor of i."""
    n = len(parents)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m


def path_to(parents: list[int], i: int) -> list[int]:
    """Node indices root..i."""
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]


@functools.lru_cache(maxsize=None)
def built_kernels():
    """The row-stable kernels (torch.ops.specdec_rs), built once into the user cache; None where
    they cannot run here."""
    from specdec import kernels
    from specdec.models.loader import cache_root

    return kernels.rowstable_ops(cache_root() / "kernels")


def need_kernels():
    """built_kernels(), or skip the test (saying why) where the kernels cannot run here. Their
    parallel calls take torch's thread count (the thread governor of an earlier test may have given
    their pool every core), so a test that sets torch's count sets theirs."""
    ops = built_kernels()
    if ops is None:
        from specdec import kernels

        pytest.skip(f"rowstable kernels unavailable here: {kernels.rowstable_unavailable()}")
    ops.set_kernel_pool(-1, -1, 0)
    return ops


def drafting_q8_op(ops):
    """The kernel a drafter's Q8_0 copies of 16-row multiples run on: q8_0_linear_q8 on 8-bit
    activations (kernel_glue.drafting_act8, the default), else the float path's q8_0_linear."""
    from specdec.models.kernel_glue import drafting_act8

    return ops.q8_0_linear_q8 if drafting_act8(ops) else ops.q8_0_linear


def prefill_ragged(native, rows: list[list[int]], max_len: int = 128):
    """Right-padded prefill of several rows, then truncate to each row's length."""
    B = len(rows)
    lens = torch.tensor([len(r) for r in rows])
    T = int(lens.max())
    toks = torch.zeros(B, T, dtype=torch.long)
    for b, r in enumerate(rows):
        toks[b, : len(r)] = torch.tensor(r)
    cache = native.new_cache(B, max_len)
    logits, _ = native(toks, torch.arange(T)[None].expand(B, T), cache)
    cache.truncate(lens)
    return cache, logits, lens


def steps_both_ways(native, seed: int, cells, switch) -> None:
    """Decoding steps (cells: (T, tree mask or None)) after ragged prompts, one row and two, with
    switch(True) then switch(False) in force: the logits must be equal bit for bit."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (9, 5)]
    for batch in ([rows[0]], rows):
        B = len(batch)
        outs = []
        for on in (True, False):
            switch(on)
            cache, _, _ = prefill_ragged(native, batch, max_len=40)
            step = []
            for T, mask in cells:
                toks = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(T))
                depth = mask.sum(-1) - 1 if mask is not None else torch.arange(T)
                am = None if mask is None else mask[None].expand(B, T, T)
                step.append(native(toks, cache.lengths[:, None] + depth[None], cache, attn_mask=am)[0])
            outs.append(torch.cat(step, 1))
        assert torch.equal(outs[0], outs[1]), B


def direct_step_switch(model, fast: list | None = None):
    """switch(on) for steps_both_ways: every layer's direct decoding-step calls (Block.fast, or
    `fast` given in their place) on, or off (the step through Linear.forward); asserts that every
    layer has them."""
    fast = [blk.fast for blk in model.layers] if fast is None else fast
    assert all(f is not None for f in fast)

    def switch(on):
        for blk, f in zip(model.layers, fast):
            blk.fast = f if on else None

    return switch


def random_eagle(target, noise: float = 0.05, saved=None, vocab_subset=None):
    """An EAGLE tree drafter (depth 3, width 2, 5 nodes) over `target` (a native model) with a
    head of seeded random weights near its initialisation: guesses of any quality, to check that
    drafting stays exact on a model's kernels (`saved`, `vocab_subset`: EagleDrafter's)."""
    from specdec.drafters.eagle import EagleDrafter, head_from_target

    torch.manual_seed(3)
    head = head_from_target(target.cfg)
    with torch.no_grad():
        for prm in head.parameters():
            prm.copy_(noise * torch.randn(prm.shape) + (1.0 if prm.dim() == 1 else 0.0))
    return EagleDrafter(head.eval(), target, vocab_subset, tree=True, depth=3, width=2, nodes=5, saved=saved)


def check_verification_equals_one_at_a_time(model) -> None:
    """A chain and a tree, verified in one forward over a ragged batch of two rows, give each node
    exactly the logits of decoding its path one token at a time after its row's prompt."""
    parents = [[-1, 0, 1, 2, 3, 4], [-1, 0, 0, 1, 2, 3]]  # row 0 a chain, row 1 a tree
    N = len(parents[0])
    prompts = [random_tokens(9, seed=20), random_tokens(14, seed=21)]
    nodes = torch.tensor([random_tokens(N, seed=22), random_tokens(N, seed=23)])
    cache, _, lens = prefill_ragged(model, prompts)
    mask = torch.stack([ancestor_mask(pa) for pa in parents])
    depth = torch.tensor([[len(path_to(pa, i)) - 1 for i in range(N)] for pa in parents])
    logits, _ = model(nodes, lens[:, None] + depth, cache, attn_mask=mask)
    for b in range(2):
        for i in range(N):
            path = [int(nodes[b, j]) for j in path_to(parents[b], i)]
            one, _, n = prefill_ragged(model, [prompts[b]])
            for t, tok in enumerate(path):  # one token per forward, as plain decoding runs
                ref, _ = model(torch.tensor([[tok]]), torch.tensor([[int(n[0]) + t]]), one)
            assert torch.equal(logits[b, i], ref[0, 0]), f"row {b} node {i}"
