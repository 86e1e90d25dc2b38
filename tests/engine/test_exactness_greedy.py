"""Greedy exactness: speculative output == transformers' plain greedy output, token for token
(docs/design.md "Why the output is exact"), for every drafter, batch 1 and a ragged
batch of 3, k in {1, 4}; plus EOS inside an accepted draft, max_new_tokens reached during an
accepted run, and stop_fn.

The oracle is `LlamaForCausalLM.generate(do_sample=False)` on the same tiny random fp32
weights, one prompt at a time (no padding), never the native model.
"""

from __future__ import annotations

import functools

import pytest
import torch

from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.engine import Engine
from specdec.types import SamplingParams

from oracle import RandomGuessDrafter, greedy_margins, hf_greedy, native_of, tiny_hf_llama

VOCAB = 64
N_NEW = 20
PROMPT_LENS = (5, 11, 8)  # ragged


pytestmark = pytest.mark.usefixtures("one_thread_per_module")


@functools.lru_cache(maxsize=None)
def models():
    target_hf = tiny_hf_llama(0, vocab=VOCAB)
    draft_hf = tiny_hf_llama(1, vocab=VOCAB, layers=1)
    return target_hf, native_of(target_hf), native_of(draft_hf)


@functools.lru_cache(maxsize=None)
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    out = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]
    # a prompt with repeats, so prompt lookup finds matches from the start
    out[2] = out[2][:4] + out[2][:4]
    return out


@functools.lru_cache(maxsize=None)
def oracle(prompt: tuple[int, ...], n: int = N_NEW) -> list[int]:
    return hf_greedy(models()[0], list(prompt), n)


def expected(batch: list[list[int]], n: int = N_NEW) -> list[list[int]]:
    return [oracle(tuple(p), n) for p in batch]


def truth_sequences(n: int = N_NEW + 8) -> list[list[int]]:
    return [p + oracle(tuple(p), n) for p in prompts()]


def make_drafter(name: str):
    _, target, draft = models()
    if name == "none":
        return None
    if name in ("ngram", "ngram_fixed"):
        return NgramDrafter()  # priced lengths, as shipped; at a fixed k the whole continuation
    if name == "draft_other":
        return DraftModelDrafter(draft)
    if name == "draft_self":
        return DraftModelDrafter(target)
    if name == "draft_confident":
        # rows stop guessing after a token the draft doubts: lengths differ per row and step
        return DraftModelDrafter(draft, confidence=0.15)
    if name == "draft_self_subset":
        # the target drafting for itself over the even ids only: right when the argmax is even
        return DraftModelDrafter(target, vocab_subset=list(range(0, VOCAB, 2)))
    if name == "hybrid":
        # prompt lookup (n >= 2) where the context repeats, the small draft model elsewhere
        return [NgramDrafter(2, 3), DraftModelDrafter(draft, lazy=True)]
    if name == "random_guesses":
        return RandomGuessDrafter(VOCAB, seed=7, mode="random")
    if name == "corrupted_truth":
        return RandomGuessDrafter(VOCAB, seed=8, mode="corrupt", truth=truth_sequences())
    raise KeyError(name)


def fixed(name: str) -> bool:
    """Whether `name`'s engine drafts at a fixed k (every step drafts; the priced lengths are
    test_policy's): a draft model alone, the whole lookup, lookup beside a draft model."""
    return name.startswith("draft") or name in ("ngram_fixed", "hybrid")


DRAFTERS = ("none", "ngram", "ngram_fixed", "draft_other", "draft_confident", "draft_self", "draft_self_subset", "hybrid", "random_guesses",
            "corrupted_truth")


def test_oracle_is_well_posed():
    """Top-2 logit gaps along the oracle trajectories are far above fp32 noise (a near-tie
    would make token-for-token comparison of two implementations meaningless)."""
    hf = models()[0]
    for p in prompts():
        cont = oracle(tuple(p), N_NEW + 8)
        assert cont[:N_NEW] == oracle(tuple(p))  # greedy(n) is a prefix of greedy(n + 8)
        assert greedy_margins(hf, p, cont) > 1e-3


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("drafter_name", DRAFTERS)
def test_greedy_equals_transformers(drafter_name, batch, k):
    _, target, _ = models()
    batch_prompts = prompts()[:batch] if batch == 1 else prompts()
    if batch == 1 and drafter_name == "ngram":
        batch_prompts = [prompts()[2]]  # the prompt with repeats
    drafter = make_drafter(drafter_name)
    streamed: dict[int, list[int]] = {}
    engine = Engine(target, drafter, k=k, fixed_k=fixed(drafter_name))
    if engine.policy is not None and engine.policy.adaptive:
        # priced as the server prices an open batch (every row's tokens), so that one row's lookup
        # is taken while the others have none: a closed batch waits for those, and stays plain
        engine.policy.closed = engine.guard.closed = False
    res = engine.generate(
        batch_prompts,
        SamplingParams(max_new_tokens=N_NEW),
        on_tokens=lambda r, ids: streamed.setdefault(r, []).extend(ids),
    )
    got = [r.tokens for r in res]
    assert got == expected(batch_prompts)
    for i, r in enumerate(res):
        assert r.stats.finish_reason == "length"
        assert r.stats.new_tokens == N_NEW
        assert streamed[i] == r.tokens  # the callback saw exactly the committed tokens
        assert r.stats.accepted <= r.stats.proposed
    proposed = sum(r.stats.proposed for r in res)
    accepted = sum(r.stats.accepted for r in res)
    if drafter_name != "none":
        assert proposed > 0, "the drafter never proposed: speculation was not exercised"
    if drafter_name == "draft_self":
        # the target drafting for itself is always right
        assert accepted == proposed
        # and each decode step commits min(k + 1, what is left): tau is close to k + 1
        for r in res:
            assert r.stats.target_forwards == -(-(N_NEW - 1) // (k + 1))
    if drafter_name in ("random_guesses", "corrupted_truth", "draft_self_subset"):
        assert accepted < proposed  # wrong guesses were made and rejected
    if drafter_name in ("corrupted_truth", "draft_self_subset"):
        assert accepted > 0  # and partial prefixes were accepted


@pytest.mark.parametrize("drafter_name", ["draft_self", "corrupted_truth", "none"])
def test_eos_inside_an_accepted_draft(drafter_name):
    """Pick an EOS id that row 0's greedy continuation first produces at index 2 (inside the
    first accepted draft when the target drafts for itself with k = 4) and one that row 1
    produces as its very first (prefill) token; every row must stop right after its first
    EOS, equal to the oracle truncated there; rows without EOS run to max_new_tokens."""
    _, target, _ = models()
    ps = prompts()
    conts = expected(ps)
    eos_a = conts[0][2]
    assert eos_a not in conts[0][:2], "pick another seed: the chosen EOS occurs earlier"
    eos_b = conts[1][0]
    assert eos_b not in conts[0][:3], "pick another seed: the second EOS would stop row 0 first"
    eos = {eos_a, eos_b}

    def cut(c):
        for j, t in enumerate(c):
            if t in eos:
                return c[: j + 1], "eos"
        return c, "length"

    engine = Engine(target, make_drafter(drafter_name), k=4, eos_ids=[eos_a, eos_b], fixed_k=fixed(drafter_name))
    res = engine.generate(ps, SamplingParams(max_new_tokens=N_NEW))
    for r, c in zip(res, conts):
        want, reason = cut(c)
        assert r.tokens == want
        assert r.stats.finish_reason == reason
    assert len(res[0].tokens) == 3 and len(res[1].tokens) == 1
    if drafter_name == "draft_self":
        # row 0: prefill token, then one step accepting 4 drafts; EOS was draft 2 of 4
        assert res[0].stats.accepted == 4 and res[0].stats.target_forwards == 1


@pytest.mark.parametrize("drafter_name", ["draft_self", "corrupted_truth", "ngram"])
@pytest.mark.parametrize("max_new", [1, 2, 3, 7, 9])
def test_max_new_tokens_reached_during_an_accepted_run(drafter_name, max_new):
    _, target, _ = models()
    ps = prompts()
    res = Engine(target, make_drafter(drafter_name), k=4, fixed_k=fixed(drafter_name)).generate(
        ps, SamplingParams(max_new_tokens=max_new))
    for r, p in zip(res, ps):
        assert len(r.tokens) == max_new
        assert r.tokens == oracle(tuple(p))[:max_new]
        assert r.stats.finish_reason == "length"
    if drafter_name == "draft_self" and max_new == 9:
        # 1 (prefill) + 5 (4 accepted + bonus) + 3 (2 accepted + bonus, drafts cut to room)
        assert all(r.stats.accepted == 6 and r.stats.target_forwards == 2 for r in res)


@pytest.mark.parametrize("drafter_name", ["none", "draft_self", "corrupted_truth"])
def test_stop_fn_stops_the_row(drafter_name):
    _, target, _ = models()
    ps = prompts()
    k = 4
    calls = []

    def stop(row, ids):
        calls.append((row, list(ids)))
        return len(ids) >= 3 + row  # row r wants 3 + r tokens

    engine = Engine(target, make_drafter(drafter_name), k=k, fixed_k=fixed(drafter_name))
    res = engine.generate(ps, SamplingParams(max_new_tokens=N_NEW), stop_fn=stop)
    for row, (r, p) in enumerate(zip(res, ps)):
        assert r.stats.finish_reason == "stop"
        assert r.tokens == oracle(tuple(p))[: len(r.tokens)]
        # stopping happens at a commit boundary: at most one step past the wish
        assert 3 + row <= len(r.tokens) <= 3 + row + k
        if drafter_name == "none":
            assert len(r.tokens) == 3 + row
    # stop_fn saw each row's full output so far, and never after that row stopped
    for row in range(len(ps)):
        seen = [ids for rr, ids in calls if rr == row]
        assert seen[-1] == res[row].tokens
        assert all(len(ids) < 3 + row for ids in seen[:-1])


def test_stop_fn_on_a_token_value():
    """A stop string's job: stop when a given token shows up (a caller-side check)."""
    _, target, _ = models()
    ps = prompts()
    conts = expected(ps)
    stop_tok = conts[0][5]
    res = Engine(target, make_drafter("draft_self"), k=4, fixed_k=True).generate(
        ps, SamplingParams(max_new_tokens=N_NEW), stop_fn=lambda r, ids: stop_tok in ids
    )
    for r, c in zip(res, conts):
        assert r.tokens == c[: len(r.tokens)]
        if stop_tok in c:
            assert r.stats.finish_reason == "stop" and stop_tok in r.tokens
        else:
            assert r.stats.finish_reason == "length"


@pytest.mark.parametrize("drafter_name", ["ngram", "hybrid", "draft_other", "corrupted_truth"])
@pytest.mark.parametrize("batch", [1, 3])
def test_adaptive_k_greedy_equals_transformers(drafter_name, batch):
    """Priced drafting (the scheduler's cost model: lookup, lookup beside a draft model, a draft
    model alone, a drafter run through the protocol): the draft length changes from step to step;
    output must not."""
    _, target, draft = models()
    batch_prompts = prompts()[:batch] if batch == 1 else prompts()
    drafter = make_drafter(drafter_name)
    if drafter_name == "corrupted_truth":
        drafter.may_skip = True  # (the sweep's drafters propose every step; this one is priced)
    engine = Engine(target, drafter, k=4)
    res = engine.generate(batch_prompts, SamplingParams(max_new_tokens=N_NEW))
    assert [r.tokens for r in res] == expected(batch_prompts)
    assert engine.policy.adaptive and engine.policy.steps.all.weight > 0, "the cost model saw no step"
    if drafter_name == "corrupted_truth":  # (a protocol drafter: its guesses' acceptance was priced)
        assert sum(r.stats.proposed for r in res) > 0, "the cost model saw no guess"


class _SlowDraft(DraftModelDrafter):
    """The target drafting for itself (always right) at 40 ms a guess, many times a step of the
    tiny target (even on a loaded machine): it would pay if drafting were free, and does not.
    Timed alone it looks free (as a draft whose cost shows only in use), so the cost model tries
    it first."""

    def __init__(self, model):
        super().__init__(model)
        self.calls = 0

    def time_alone(self) -> tuple[float, float]:
        return 1e-6, 1e-6

    def _propose(self, ctx, max_tokens):
        import time as _t

        self.calls += 1
        _t.sleep(0.04 * max_tokens)
        return super()._propose(ctx, max_tokens)


def test_the_cost_model_turns_off_a_draft_model_that_does_not_pay():
    """auto with a draft model in generate: a draft model whose guesses hold but cost more time
    than they save is dropped by the scheduler's cost model once it is measured (a rule that
    priced drafting as free would keep it), and the output is still the oracle's."""
    _, target, _ = models()
    p = prompts()[0]
    n_new = 60
    slow = _SlowDraft(target)
    slow.lazy = True
    engine = Engine(target, [NgramDrafter(5, 6), slow], k=3)
    engine.policy.probe_room = 0  # (the draft model may start on an answer of any length)
    res = engine.generate([p], SamplingParams(max_new_tokens=n_new))[0]
    assert res.tokens == oracle(tuple(p), n_new)
    steps = res.stats.target_forwards
    assert 1 <= slow.calls < steps / 4, (slow.calls, steps)


def _scores_fed(model, rows: list[list[int]]) -> torch.Tensor:
    """The draft's scores at each row's last token, reading exactly `rows` into a fresh cache."""
    d = DraftModelDrafter(model)
    d.begin(rows, SamplingParams(), 64)
    d.CATCH_UP_WINDOW = None
    return d._feed(rows)


def test_a_draft_model_catches_up_on_a_window(monkeypatch):
    """A row further behind than CATCH_UP_WINDOW reads its first SINK_TOKENS and its last
    CATCH_UP_WINDOW tokens (a prompt), or its last CATCH_UP_WINDOW (steps it sat out), positions
    running on in the cache: its guesses are those of a draft that read exactly that cut (an
    independent feed; a cut without the sinks gives other scores, so the check can fail), its
    lag is priced at the cut, rollback keeps the cut, and greedy output is still the oracle's."""
    from specdec.drafters.base import DraftContext

    monkeypatch.setattr(DraftModelDrafter, "CATCH_UP_WINDOW", 6)
    monkeypatch.setattr(DraftModelDrafter, "SINK_TOKENS", 2)
    _, target, draft = models()
    params = SamplingParams(max_new_tokens=8)
    g = torch.Generator().manual_seed(5)
    long = torch.randint(0, VOCAB, (30,), generator=g).tolist()
    d = DraftModelDrafter(draft)
    d.begin([long], params, 64)
    assert d.lags([long]) == [8]
    cut = long[:2] + long[-6:]
    scores = d._feed([long], [d._window(0, long)])
    assert torch.allclose(scores, _scores_fed(draft, [cut]), atol=1e-5)
    assert not torch.allclose(scores, _scores_fed(draft, [long[-8:]]), atol=1e-3)  # the sinks count
    assert d.fed == [long] and d.skipped == [22] and int(d.cache.lengths[0]) == 8
    more = long + [3, 4]
    drafted = d.propose(DraftContext([more], params, None), 3).tokens[0].tolist()
    d.commit([1])  # the cache keeps the cut, the two new tokens and one guess
    assert d.fed == [more + drafted[:1]] and int(d.cache.lengths[0]) == 8 + 2 + 1
    sat_out = more + drafted[:1] + list(range(10, 20))  # ten steps sat out: their last six read
    d.propose(DraftContext([sat_out], params, None), 1)
    assert d.skipped == [22 + 4] and int(d.cache.lengths[0]) == 11 + 6
    read = cut + [3, 4] + drafted[:1] + sat_out[-6:]  # what the cache holds, in order
    assert torch.allclose(d._forward([[7]]), _scores_fed_next(draft, read, 7), atol=1e-5)
    batch = [long, prompts()[1]]
    engine = Engine(target, DraftModelDrafter(draft), k=3, fixed_k=True)
    res = engine.generate(batch, SamplingParams(max_new_tokens=N_NEW))
    assert [r.tokens for r in res] == [hf_greedy(models()[0], long, N_NEW), oracle(tuple(prompts()[1]))]
    assert sum(r.stats.accepted for r in res) > 0


def _scores_fed_next(model, row: list[int], token: int) -> torch.Tensor:
    """The draft's scores after reading `row`, then `token` alone (a drafting step)."""
    d = DraftModelDrafter(model)
    d.begin([row], SamplingParams(), 64)
    d.CATCH_UP_WINDOW = None
    d._feed([row])
    return d._feed([[token]])


def test_engine_names_a_bad_prompt_from_one():
    """Errors number prompts from 1, as the CLI does ("prompt 2"), or say "the prompt" for one."""
    from specdec.types import SpecdecError

    engine = Engine(models()[1], NgramDrafter(), k=2)
    with pytest.raises(SpecdecError, match="prompt 2 is empty"):
        engine.generate([[1, 2, 3], []], SamplingParams(max_new_tokens=2))
    with pytest.raises(SpecdecError, match="the prompt has 5000 tokens"):
        engine.generate([[1] * 5000], SamplingParams(max_new_tokens=2))


def test_timing_a_draft_model_alone_leaves_its_rows_as_they_were():
    """DraftModelDrafter.time_alone (how auto prices a draft model before its first proposal)
    runs on a scratch cache: the rows' cache and fed tokens stay as they were, the next proposal
    is the one an untimed drafter makes, and the priced hybrid's greedy output is still the
    oracle's."""
    from specdec.drafters.base import DraftContext

    _, target, draft = models()
    params = SamplingParams(max_new_tokens=8)
    timed, plain = DraftModelDrafter(draft), DraftModelDrafter(draft)
    ctx = DraftContext([prompts()[0]], params, None)
    for d in (timed, plain):
        d.begin([prompts()[0]], params, 64)
        d.propose(ctx, 3)
        d.commit([1])
    before = (timed.cache.lengths.clone(), [list(f) for f in timed.fed])
    assert min(timed.time_alone()) > 0
    assert torch.equal(timed.cache.lengths, before[0]) and timed.fed == before[1]
    ctx = DraftContext([prompts()[0] + [5, 6]], params, None)
    assert torch.equal(timed.propose(ctx, 3).tokens, plain.propose(ctx, 3).tokens)
    engine = Engine(target, [NgramDrafter(2, 3), DraftModelDrafter(draft, lazy=True)], k=4)
    engine._scheduler(prompts()[:2], params)  # a new batch times an untimed draft model alone
    draft_stats = engine.policy.sources["draft"]
    assert draft_stats.timed and draft_stats.t_catch > 0 and engine.policy.steps.all.weight == 0
    res = engine.generate(prompts()[:2], SamplingParams(max_new_tokens=N_NEW))
    assert [r.tokens for r in res] == expected(prompts()[:2])
