"""A request's predicted output as a draft source: it follows the answer through the prediction,
re-aligns after an edit (inserted, deleted or changed text), and offers the prediction's next
tokens; greedy output equals plain decoding with any prediction (right, edited or wrong), and a
right prediction is verified in long runs."""

from __future__ import annotations

import random

import pytest
import torch

from helpers import fitted, prompts, target, target_dir
from specdec.drafters.base import DraftContext, RowInfo
from specdec.drafters.prediction import PredictionDrafter
from specdec.engine import Engine
from specdec.types import SamplingParams

from oracle import hf_greedy


def offers(pred: list[int], prompt: list[int], answers: list[list[int]], k: int = 4):
    """What the source offers after each answer so far (prompt + answer, pending token last)."""
    d = PredictionDrafter()
    d.begin([], None, 512)
    d.join(RowInfo(prompt, SamplingParams(), 512, prediction=pred))
    out = []
    for answer in answers:
        [o] = d.offer(DraftContext([prompt + answer], SamplingParams(), None), k)
        out.append(None if o is None else (o.tokens, o.key))
    return out


def test_it_follows_the_answer_and_offers_what_comes_next():
    pred = list(range(10, 30))
    got = offers(pred, [1, 2], [[10], [10, 11, 12], [10, 11, 12, 13, 14, 15, 16, 17]])
    assert got[0] == ([11, 12, 13, 14], 1)
    assert got[1] == ([13, 14, 15, 16], 2)  # (3 tokens held: key 2, i.e. 2-3)
    assert got[2] == ([18, 19, 20, 21], 4)  # (8 held: key 4, i.e. 8-15)


@pytest.mark.parametrize("edit,answer,want", [
    # a changed token: the next tokens of the answer are found again after it
    ("change", [10, 11, 99, 13, 14], [15, 16, 17, 18]),
    # inserted text, then the prediction resumes
    ("insert", [10, 11, 12, 90, 91, 92, 13, 14], [15, 16, 17, 18]),
    # deleted text: the answer skips ahead in the prediction
    ("delete", [10, 11, 12, 20, 21], [22, 23, 24, 25]),
])
def test_it_realigns_after_an_edit(edit, answer, want):
    pred = list(range(10, 40))
    [got] = offers(pred, [1], [answer])
    assert got is not None and got[0] == want and got[1] == 2, (edit, got)  # re-aligned on two tokens


def test_it_offers_nothing_until_the_answer_meets_the_prediction_again():
    pred = list(range(10, 40))
    assert offers(pred, [1], [[10, 11, 90, 91]]) == [None]  # lost: 90 91 is not in the prediction
    assert offers(pred, [1], [[10, 11, 90, 91, 30, 31]]) == [([32, 33, 34, 35], 2)]


def test_a_repeated_phrase_realigns_to_its_nearest_occurrence_ahead():
    pred = [5, 6, 7, 1, 2, 3, 4, 5, 6, 7, 8, 9, 5, 6, 7, 50]
    # the answer followed up to index 6 (token 4), then changed, then "5 6 7": the one at 7..9 is ahead
    [got] = offers(pred, [0], [[5, 6, 7, 1, 2, 3, 4, 77, 5, 6, 7]])
    assert got[0] == [8, 9, 5, 6]


def test_rows_without_a_prediction_offer_nothing_and_rows_move_with_the_batch():
    d = PredictionDrafter()
    d.begin([], None, 64)
    d.join(RowInfo([1], SamplingParams(), 64))
    d.join(RowInfo([1], SamplingParams(), 64, prediction=[7, 8, 9]))
    ctx = DraftContext([[1, 3], [1, 7]], SamplingParams(), None)
    assert d.offer(ctx, 2)[0] is None and d.offer(ctx, 2)[1].tokens == [8, 9]
    d.keep_rows([1])
    assert d.offer(DraftContext([[1, 7, 8]], SamplingParams(), None), 2)[0].tokens == [9]


@pytest.mark.parametrize("kind", ["exact", "edited", "wrong"])
def test_greedy_output_does_not_depend_on_the_prediction(kind):
    """Tiny random target: the answer with a prediction equals transformers' plain greedy answer,
    whether the prediction is that answer, that answer with edits, or random tokens; a right
    prediction is verified in long runs (few target forwards)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(target_dir(0)), dtype=torch.float32).eval()
    hf.generation_config.pad_token_id = 0
    ps = prompts()
    n = 40
    want = [hf_greedy(hf, p, n) for p in ps]
    rng = random.Random(0)
    if kind == "exact":
        preds = [list(w) for w in want]  # the whole answer, as a client sends it
    elif kind == "edited":
        preds = [w[1:12] + [rng.randrange(32) for _ in range(3)] + w[15:30] + w[33:] for w in want]
    else:
        preds = [[rng.randrange(32) for _ in range(n)] for _ in want]
    engine = Engine(target().model, [PredictionDrafter()], k=8)
    # timed steps with cheap guesses first: how far a right prediction is verified then does not
    # depend on this machine's load while the fit learns its step times (a fresh batch prices a
    # guess slot at a row's whole share)
    fitted(engine.policy, rows=len(ps), per_guess=0.01)
    res = engine.generate(ps, SamplingParams(max_new_tokens=n), predictions=preds)
    assert [r.tokens for r in res] == want
    if kind == "exact":
        assert all(r.stats.sources["prediction"][1] >= n // 2 for r in res), [r.stats.sources for r in res]
        assert all(r.stats.target_forwards <= n // 3 for r in res), [r.stats.target_forwards for r in res]
