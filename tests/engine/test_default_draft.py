"""The drafters shipped for the default model (the distilled draft, the EAGLE head, the
Medusa heads): they load as the defaults, and greedy speculation reproduces plain greedy
decoding token for token on the default model (batch 1 and a ragged batch), for draft,
auto (lookup + EAGLE, and lookup + the draft with --draft), eagle (tree and chain) and
medusa (tree and chain)."""

from __future__ import annotations

import pytest

import helpers
from model_helpers import drafting_q8_op

from specdec.config import SpecConfig, build_engine
from specdec.drafters.eagle import DEFAULT_EAGLE_DIR, default_eagle_for
from specdec.drafters.medusa import DEFAULT_MEDUSA_DIR, default_medusa_for
from specdec.models.loader import DEFAULT_DRAFT_DIR, default_draft_for
from specdec.text import encode_prompt
from specdec.types import SamplingParams

PROMPTS = [
    ("Write a Python function that checks whether a number is prime.", None),
    ("Summarize: The quick brown fox jumps over the lazy dog. The dog does not move. The fox runs away.", None),
    ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", False),
]


@pytest.mark.default_model
def test_default_draft_ships_and_loads(default_model):
    assert (DEFAULT_DRAFT_DIR / "config.json").is_file(), "the default draft is missing from the package"
    assert default_draft_for(default_model) == DEFAULT_DRAFT_DIR
    assert default_eagle_for(default_model) == DEFAULT_EAGLE_DIR, "the default EAGLE head is missing"
    assert default_medusa_for(default_model) == DEFAULT_MEDUSA_DIR, "the default Medusa heads are missing"


def _config(method, tree=True, draft=None):
    return SpecConfig(method=method, draft=draft, tree=tree)


@pytest.mark.default_model
@pytest.mark.parametrize("method,tree,draft", [("draft", True, None), ("auto", True, None),
                                               ("auto", True, str(DEFAULT_DRAFT_DIR)), ("eagle", True, None),
                                               ("eagle", False, None), ("medusa", True, None), ("medusa", False, None)])
def test_greedy_speculation_equals_plain_on_default_model(default_model, method, tree, draft, monkeypatch):
    tok = default_model.tokenizer
    ids = [encode_prompt(tok, p, chat) for p, chat in PROMPTS]
    params = SamplingParams(max_new_tokens=48)
    plain_engine = build_engine(_config("none"), default_model)
    plain = [plain_engine.generate([x], params)[0].tokens for x in ids]
    engine = build_engine(_config(method, tree, draft), default_model)
    helpers.always_drafting(monkeypatch, engine.policy)  # drafted whatever this machine's timing
    if method == "draft" or draft is not None:  # the shipped draft, with its vocabulary-subset head
        draft_drafter = next(d for d in engine.sources if d.label == "draft")
        assert draft_drafter.subset is not None and len(draft_drafter.subset) > 0
    if method == "auto":  # the default target's auto: lookup + the shipped EAGLE head; --draft MODEL: + the draft
        assert [d.label for d in engine.sources] == ["ngram", "suffix", "draft" if draft else "eagle", "prediction",
                                                     "grammar"]
    one_by_one = [engine.generate([x], params)[0] for x in ids]
    assert [r.tokens for r in one_by_one] == plain
    assert sum(r.stats.accepted for r in one_by_one) > 0  # the draft is right some of the time
    batched = engine.generate(ids, params)
    assert [r.tokens for r in batched] == plain


@pytest.fixture(scope="module")
def default_model_bf16():
    import torch

    from specdec.models.loader import load_model

    return load_model(None, dtype=torch.bfloat16, quiet=True)


@pytest.mark.default_model
@pytest.mark.parametrize("method", ["auto", "draft", "medusa"])
def test_greedy_speculation_equals_plain_in_bfloat16(default_model_bf16, method, monkeypatch):
    """`--dtype bfloat16`: speculative greedy text equals plain bf16 greedy text token for token
    (a verification forward's logits equal one-at-a-time decoding's: the model attends in
    float64, see models.llama), alone and in a ragged batch against the same batch decoded
    plainly; auto mixes lookup chains and EAGLE trees, medusa verifies a static tree."""
    lm = default_model_bf16
    ids = [encode_prompt(lm.tokenizer, p, chat) for p, chat in PROMPTS]
    params = SamplingParams(max_new_tokens=48)
    plain_engine = build_engine(_config("none"), lm)
    plain = [plain_engine.generate([x], params)[0].tokens for x in ids]
    engine = build_engine(_config(method), lm)
    helpers.always_drafting(monkeypatch, engine.policy)
    one_by_one = [engine.generate([x], params)[0] for x in ids]
    assert [r.tokens for r in one_by_one] == plain
    assert sum(r.stats.accepted for r in one_by_one) > 0
    batched = [r.tokens for r in engine.generate(ids, params)]
    assert batched == [r.tokens for r in plain_engine.generate(ids, params)]


@pytest.mark.default_model
def test_prepacked_subset_head_scores_like_the_plain_one(default_model):
    """The shipped draft's vocabulary-subset head runs prepacked (bf16 where the CPU has it):
    its scores stay within bf16 rounding of the plain product, and so do the steady-state
    one-token feeds against a fresh multi-token feed of the same text."""
    import torch

    from specdec.drafters.draft_model import DraftModelDrafter
    from specdec.models.loader import default_draft_for, load_model
    from specdec.types import SamplingParams

    d = load_model(str(default_draft_for(default_model)), quiet=True)
    subset = d.draft_meta["vocab_subset"]
    packed = DraftModelDrafter(d.model, vocab_size=default_model.model.vocab_size, vocab_subset=subset)
    plain = DraftModelDrafter(d.model, vocab_size=default_model.model.vocab_size, vocab_subset=subset)
    plain.head_packed = None
    ctx = list(range(300, 340))
    for dr in (packed, plain):
        dr.begin([ctx], SamplingParams(), 128)
    a, b = packed._feed([ctx]), plain._feed([ctx])
    assert a.shape == b.shape == (1, len(subset))
    assert (a - b).abs().max() <= 0.05 * b.abs().max()  # bf16 inputs: a few parts in a thousand
    if packed.head_packed is not None:
        assert int(a.argmax()) == int(b.argmax())
    steps = [plain._feed([[t]]) for t in (7, 8, 9)]  # the one-token fast path (fp32 head: no bf16 noise)
    fresh = DraftModelDrafter(d.model, vocab_size=default_model.model.vocab_size, vocab_subset=subset)
    fresh.head_packed = None
    fresh.begin([ctx], SamplingParams(), 128)
    whole = fresh._feed([ctx + [7, 8, 9]])
    assert torch.allclose(steps[-1], whole, atol=1e-3 * float(whole.abs().max()))
    assert plain.fed[0] == ctx + [7, 8, 9] and int(plain.cache.lengths[0]) == len(ctx) + 3


@pytest.mark.default_model
def test_draft_model_runs_on_the_targets_row_stable_kernels(default_model):
    """Beside the GGUF target on the row-stable kernels, the shipped draft (loaded unpacked, as the
    CLI loads drafts) computes on Q8_0 copies of its own weights through the same kernels: every
    layer takes the direct decoding step (Block.fast) and the subset head is on the kernels. Its
    scores stay within the quantisation's error of the float32 draft's, on a multi-token feed and
    on the one-token steps that follow (a broken layout or scale would be far off), and its guesses
    mostly agree with the float32 draft's. (Greedy equality with plain decoding on this draft: the
    build_engine test above.)"""
    import torch

    from specdec.drafters.draft_model import DraftModelDrafter
    from specdec.models.loader import default_draft_for, load_model

    ops = default_model.model.rowstable
    if ops is None:
        pytest.skip("the target is not on the row-stable kernels on this CPU")
    path = str(default_draft_for(default_model))
    plain = load_model(path, quiet=True, pack=False)
    subset = plain.draft_meta["vocab_subset"]
    V = default_model.model.vocab_size
    ref = DraftModelDrafter(plain.model, V, subset)  # float32, unpacked
    q8 = DraftModelDrafter(load_model(path, quiet=True, pack=False).model, V, subset, target_model=default_model.model)
    assert ref.head_rs is None and q8.head_rs is not None and q8.head_rs[0] == drafting_q8_op(ops)
    assert all(blk.fast is not None and blk.kops is ops for blk in q8.model.layers)
    assert all(lin.weight is None for blk in q8.model.layers for lin in (blk.wqkv, blk.wo, blk.w_gate_up, blk.w_down))
    ctx = default_model.tokenizer.encode("def is_prime(n):\n    \"\"\"Whether n is a prime number.\"\"\"\n    if n < 2:\n")
    for dr in (ref, q8):
        dr.begin([ctx], SamplingParams(), 256)
    feeds = [(ref._feed([ctx]), q8._feed([ctx]))]
    for t in default_model.tokenizer.encode("        return False\n    for i in range(2, n):"):
        feeds.append((ref._feed([[t]]), q8._feed([[t]])))
    agree = 0
    for a, b in feeds:
        assert a.shape == b.shape == (1, len(subset))
        assert (a - b).abs().max() <= 0.08 * a.abs().max(), "the Q8_0 draft's scores are off the float32 draft's"
        agree += int(a.argmax()) == int(b.argmax())
    assert agree >= len(feeds) - 2
