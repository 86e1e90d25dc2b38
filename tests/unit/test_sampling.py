"""sampling.warp against transformers' logits processors; choose; seeding; parameter checks."""

from __future__ import annotations

import pytest
import torch

from oracle import chi2_test

from specdec.sampling import choose, make_generator, sample, warp
from specdec.types import SamplingParams, SpecdecError


def hf_warp(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The oracle: transformers' warpers in generate's order, then softmax. [..., V]."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    procs = [TemperatureLogitsWarper(p.temperature)]
    if p.top_k:
        procs.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        procs.append(TopPLogitsWarper(p.top_p))
    if p.min_p > 0.0:
        procs.append(MinPLogitsWarper(p.min_p))
    shape = logits.shape
    x = logits.reshape(-1, shape[-1]).clone().float()
    ids = torch.zeros(x.shape[0], 1, dtype=torch.long)
    for proc in procs:
        x = proc(ids, x)
    return x.softmax(-1).reshape(shape)


SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.7),
    dict(temperature=1.5, top_k=5),
    dict(temperature=1.0, top_k=1),
    dict(temperature=1.0, top_k=1000),  # larger than V: off
    dict(temperature=0.8, top_p=0.9),
    dict(temperature=1.0, top_p=0.3),
    dict(temperature=1.0, top_p=1e-6),  # keeps only the top token
    dict(temperature=1.2, min_p=0.1),
    dict(temperature=0.5, min_p=0.5),
    dict(temperature=0.9, top_k=20, top_p=0.8),
    dict(temperature=1.3, top_k=30, top_p=0.95, min_p=0.05),
    dict(temperature=2.0, top_p=0.5, min_p=0.2),
]


@pytest.mark.parametrize("kw", SETTINGS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_warp_matches_transformers(kw):
    p = SamplingParams(**kw)
    g = torch.Generator().manual_seed(0)
    logits = 3.0 * torch.randn(6, 64, generator=g)  # [B, V]
    got = warp(logits, p)
    ref = hf_warp(logits, p)
    assert got.shape == logits.shape and got.dtype == torch.float32
    assert torch.equal(got > 0, ref > 0), "different support"
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got.sum(-1), torch.ones(6), atol=1e-5, rtol=0)


def test_warp_3d_matches_transformers():
    """Verification warps [B, K+1, V] at once."""
    p = SamplingParams(temperature=0.8, top_k=10, top_p=0.9, min_p=0.02)
    logits = 2.0 * torch.randn(3, 5, 50, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(warp(logits, p), hf_warp(logits, p), atol=1e-6, rtol=1e-5)


def test_warp_top_k_keeps_ties():
    # integer logits have ties at the k-th value; transformers keeps all of them
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0, 2.0, -1.0]])
    for kw in (dict(temperature=1.0, top_k=2), dict(temperature=0.5, top_k=3)):
        p = SamplingParams(**kw)
        torch.testing.assert_close(warp(logits, p), hf_warp(logits, p), atol=1e-6, rtol=1e-5)


def test_warp_handles_low_precision_logits():
    p = SamplingParams(temperature=0.7, top_p=0.9)
    logits = (3.0 * torch.randn(2, 40, generator=torch.Generator().manual_seed(2))).to(torch.bfloat16)
    got = warp(logits, p)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, hf_warp(logits.float(), p), atol=1e-6, rtol=1e-5)


def test_warp_refuses_greedy():
    with pytest.raises(ValueError):
        warp(torch.zeros(1, 4), SamplingParams(temperature=0.0))


def test_greedy_choose_is_argmax():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(3))
    got = choose(logits, SamplingParams(), None)
    expect = [max(range(100), key=lambda j: float(row[j])) for row in logits]
    assert got.tolist() == expect
    # greedy consumes no randomness and ignores top-k etc.
    g = make_generator(0)
    state = g.get_state()
    assert choose(logits, SamplingParams(top_k=3, top_p=0.5), g).tolist() == expect
    assert torch.equal(g.get_state(), state)


def test_same_seed_same_samples():
    logits = torch.randn(4, 200, generator=torch.Generator().manual_seed(4))
    p = SamplingParams(temperature=1.0, seed=123)

    def run(seed):
        g = make_generator(seed)
        return [choose(logits, p, g).tolist() for _ in range(20)]

    assert run(123) == run(123)
    assert run(123) != run(124)


def test_sample_stays_in_warped_support():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(5))
    p = SamplingParams(temperature=1.5, top_k=4)
    top4 = logits.topk(4, dim=-1).indices
    g = make_generator(7)
    for _ in range(50):
        tok = choose(logits, p, g)
        for b in range(3):
            assert int(tok[b]) in top4[b].tolist()


def test_sample_frequencies_follow_probs():
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    g = make_generator(11)
    n = 4000
    counts = torch.zeros(4)
    for t in sample(probs.expand(n, 4), g).tolist():
        counts[t] += 1
    assert counts[3] == 0
    freq = counts / n
    assert (freq - probs[0]).abs().max() < 0.04


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=-0.1),
        dict(temperature=float("nan")),
        dict(temperature=float("inf")),  # every token equally likely: a typo, not a setting
        dict(seed=2**63),  # past torch's 64-bit generator seed
        dict(seed=-(2**63) - 1),
        dict(seed=1.5),
        dict(top_p=0.0),
        dict(top_p=1.01),
        dict(top_p=-0.5),
        dict(top_k=-1),
        dict(top_k=2.5),
        dict(min_p=-0.01),
        dict(min_p=1.0),
        dict(min_p=1.5),
        dict(max_new_tokens=0),
        dict(max_new_tokens=-3),
    ],
)
def test_sampling_params_rejects(kw):
    with pytest.raises(SpecdecError):
        SamplingParams(**kw)


def test_sampling_params_accepts_edges():
    SamplingParams(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, max_new_tokens=1)
    SamplingParams(temperature=5, top_p=1e-9, top_k=1, min_p=0.999)
    SamplingParams(seed=2**63 - 1)
    SamplingParams(seed=-(2**63))
    assert SamplingParams().greedy and not SamplingParams(temperature=0.1).greedy


@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 5e-324, 1e-20, 9e-5])
@pytest.mark.parametrize("kw", [{}, {"top_p": 0.5}, {"top_k": 3}, {"min_p": 0.5}])
def test_tiny_temperatures_sample_the_argmax(temperature, kw):
    """A temperature far below 1 is the limit distribution: all mass on the argmax (shared among
    exact ties). Dividing float32 logits by 1e-40 overflowed to inf, softmax gave NaN and
    torch.multinomial raised inside the server's batch."""
    logits = 30.0 * torch.randn(4, 500, generator=torch.Generator().manual_seed(7))
    logits[3, 10] = logits[3, 11] = logits[3].max() + 1.0  # an exact tie
    probs = warp(logits, SamplingParams(temperature=temperature, **kw))
    assert torch.isfinite(probs).all()
    want = torch.zeros_like(probs)
    want[torch.arange(3), logits[:3].argmax(-1)] = 1.0
    want[3, 10] = want[3, 11] = 0.5
    torch.testing.assert_close(probs[:3], want[:3], atol=1e-6, rtol=0)
    if "top_p" not in kw:  # (top-p 0.5 keeps one of the two tied tokens, as transformers does)
        torch.testing.assert_close(probs[3], want[3], atol=1e-6, rtol=0)
    assert float(probs[3, 10] + probs[3, 11]) == pytest.approx(1.0)
    g = make_generator(1)
    assert (sample(probs[:3], g) == logits[:3].argmax(-1)).all()


def test_moderate_temperatures_are_warped_as_before():
    """Above SMALL_TEMPERATURE the logits are divided as they always were (bit for bit), so seeded
    samples do not change."""
    logits = 3.0 * torch.randn(2, 300, generator=torch.Generator().manual_seed(4))
    for t in (1e-3, 0.7, 1.0, 5.0):
        assert torch.equal(warp(logits, SamplingParams(temperature=t)), (logits / t).softmax(-1))


def test_sample_follows_the_probabilities():
    """`sample` (inverse transform over a float64 running sum) draws each token with its
    probability: chi-square against the exact probabilities of an unnormalised row with zeros,
    tiny and large masses; tokens without mass are never drawn."""
    g = torch.Generator().manual_seed(3)
    w = torch.rand(60, generator=g) ** 4
    w[[0, 7, 8, 59]] = 0.0  # no mass at the first, in the middle and at the last token
    w[20] = 1e-6
    n = 60_000
    drawn = sample(w.expand(n, -1), make_generator(11))
    assert drawn.shape == (n,)
    assert not bool(torch.isin(drawn, torch.tensor([0, 7, 8, 59])).any())
    result = chi2_test(torch.bincount(drawn, minlength=60).double(), w.double() / w.double().sum())
    assert not result.rejected, result


def test_sample_skips_tokens_without_mass_at_the_edges_of_the_uniform(monkeypatch):
    """u = 0 must not pick a leading token without mass, and u * total rounding up to the total
    must pick the last token with mass, not a zero or one past the end."""
    probs = torch.tensor([0.0, 0.25, 0.75, 0.0, 0.0])
    for u, want in ((0.0, 1), (1.0, 2)):
        monkeypatch.setattr(torch, "rand", lambda *a, u=u, **k: torch.full(a[:2], u, dtype=torch.float64))
        assert int(sample(probs, None)) == want


@pytest.mark.parametrize("row", [[0.0, 0.0], [float("nan"), 1.0], [float("inf"), 1.0], [-0.5, 1.0]])
def test_sample_refuses_rows_that_are_no_distribution(row):
    with pytest.raises(ValueError, match="invalid probability distribution"):
        sample(torch.tensor([[0.2, 0.8], row]), make_generator(0))
