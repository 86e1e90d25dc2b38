"""verify_greedy / verify_stochastic (pure functions) against worked examples and exact
distributions (docs/design.md "Why the output is exact").

The distribution checks draw many seeded trials (batched as rows of one call) and apply a
chi-square test at alpha = 1e-3 against the *analytic* target distribution; the same check
applied to a deliberately broken verifier (tests/oracle.py) must reject, which proves the
check can fail.
"""

from __future__ import annotations

import pytest
import torch

from specdec.verify import verify_greedy, verify_stochastic

from oracle import broken_verify_stochastic, chi2_critical, chi2_test, histogram

ALPHA = 1e-3
V = 6
P = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.07, 0.03])  # target, one position
P_BONUS = torch.tensor([0.05, 0.05, 0.10, 0.20, 0.25, 0.35])
P_TOPK = torch.tensor([0.50, 0.30, 0.20, 0.0, 0.0, 0.0])  # a target after top-k: zeros allowed


pytestmark = pytest.mark.usefixtures("one_thread_per_module")


def _confidently_wrong(p: torch.Tensor) -> torch.Tensor:
    """0.99 on the least likely possible token, the rest spread evenly."""
    worst = int(p.masked_fill(p <= 0, 2.0).argmin())
    q = torch.full((V,), 0.01 / (V - 1))
    q[worst] = 0.99
    return q


Q_CASES = {
    "q_equals_p": lambda p: p.clone(),
    "q_uniform": lambda p: torch.full((V,), 1.0 / V),
    "q_confidently_wrong": _confidently_wrong,
    "q_peaked_elsewhere": lambda p: torch.tensor([0.02, 0.02, 0.02, 0.02, 0.02, 0.90]),
    "q_none": None,  # deterministic guesses
}


def _one_hot_logits(best: list[list[int]], vocab: int = 8) -> torch.Tensor:
    """Logits [B, K+1, V] whose argmax at [b, i] is best[b][i] (clear margins)."""
    B, K1 = len(best), len(best[0])
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, K1, vocab, generator=g)
    for b in range(B):
        for i in range(K1):
            logits[b, i, best[b][i]] = 10.0
    return logits


# ----------------------------------------------------------------------------------------
# the chi-square machinery itself
# ----------------------------------------------------------------------------------------


def test_chi2_critical_matches_table():
    # standard table values for alpha = 1e-3 and 0.05
    for df, alpha, want in [(1, 1e-3, 10.828), (5, 1e-3, 20.515), (10, 1e-3, 29.588), (35, 1e-3, 66.619), (4, 0.05, 9.488)]:
        assert chi2_critical(df, alpha) == pytest.approx(want, abs=2e-3)


def test_chi2_accepts_exact_samples_and_rejects_wrong_ones():
    g = torch.Generator().manual_seed(123)
    x = torch.multinomial(P.expand(20000, V), 1, replacement=True, generator=g).squeeze(1)
    h = histogram(x[:, None], (V,))
    assert not chi2_test(h, P, ALPHA).rejected
    shifted = torch.tensor([0.38, 0.27, 0.15, 0.10, 0.07, 0.03])  # a 2-point shift
    assert chi2_test(h, shifted, ALPHA).rejected
    impossible = h.clone()
    impossible[3] += 1
    assert chi2_test(impossible, P_TOPK, ALPHA).stat == float("inf")


# ----------------------------------------------------------------------------------------
# greedy: worked examples
# ----------------------------------------------------------------------------------------


def test_verify_greedy_worked_examples():
    # argmax per position (K = 4 drafts, 5 positions): 3 1 4 1 5
    best = [3, 1, 4, 1, 5]
    rows = [
        # (draft, count) -> (accepted, next)
        ([3, 1, 4, 1], 4, 4, 5),  # full accept: bonus from position K
        ([3, 1, 0, 1], 4, 2, 4),  # first mismatch at 2 emits argmax there; later match ignored
        ([2, 1, 4, 1], 4, 0, 3),  # immediate mismatch
        ([3, 1, 4, 1], 2, 2, 4),  # count 2 < K: stop after 2 even though d3 would match
        ([3, 1, 4, 1], 0, 0, 3),  # nothing proposed: plain decode from position 0
        ([3, 1, 4, 7], 3, 3, 1),  # accepted all of its 3: next from position 3
        ([3, 6, 4, 1], 1, 1, 1),  # count 1, accepted: next from position 1
    ]
    logits = _one_hot_logits([best] * len(rows))
    drafts = torch.tensor([r[0] for r in rows])
    counts = torch.tensor([r[1] for r in rows])
    n_acc, nxt = verify_greedy(logits, drafts, counts)
    assert n_acc.tolist() == [r[2] for r in rows]
    assert nxt.tolist() == [r[3] for r in rows]


def test_verify_greedy_rows_with_different_targets():
    best = [[0, 1, 2, 3], [5, 5, 5, 5], [7, 6, 5, 4]]
    drafts = torch.tensor([[0, 1, 2], [5, 4, 5], [7, 6, 5]])
    logits = _one_hot_logits(best)
    n_acc, nxt = verify_greedy(logits, drafts, torch.tensor([3, 3, 2]))
    assert n_acc.tolist() == [3, 1, 2]
    assert nxt.tolist() == [3, 5, 5]


def test_verify_greedy_empty_draft():
    logits = _one_hot_logits([[4], [2]])
    n_acc, nxt = verify_greedy(logits, torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    assert n_acc.tolist() == [0, 0] and nxt.tolist() == [4, 2]


# ----------------------------------------------------------------------------------------
# stochastic: exact, deterministic properties
# ----------------------------------------------------------------------------------------


def test_stochastic_one_hot_targets_behave_like_greedy():
    # p one-hot -> acceptance and the recovered token are deterministic
    best = [[3, 1, 4, 1, 5]] * 4 + [[0, 2, 2, 0, 1]]
    tp = torch.zeros(5, 5, 8)
    for b, row in enumerate(best):
        for i, t in enumerate(row):
            tp[b, i, t] = 1.0
    drafts = torch.tensor([[3, 1, 4, 1], [3, 1, 0, 1], [2, 1, 4, 1], [3, 1, 4, 1], [0, 2, 2, 0]])
    counts = torch.tensor([4, 4, 4, 2, 3])
    for q in (None, torch.full((5, 4, 8), 1 / 8)):
        n_acc, nxt = verify_stochastic(tp, drafts, q, counts, torch.Generator().manual_seed(0))
        assert n_acc.tolist() == [4, 2, 0, 2, 3]
        assert nxt.tolist() == [5, 4, 3, 4, 0]


def test_stochastic_q_equals_p_always_accepts_and_zero_p_always_rejects():
    B, K = 500, 3
    g = torch.Generator().manual_seed(1)
    tp = torch.softmax(torch.randn(B, K + 1, V, generator=g) * 2, -1)
    tp[:, :, 5] = 0.0
    tp = tp / tp.sum(-1, keepdim=True)
    qs = tp[:, :K].clone()
    drafts = torch.multinomial(qs.reshape(-1, V), 1, generator=g).reshape(B, K)
    n_acc, _ = verify_stochastic(tp, drafts, qs, torch.full((B,), K), torch.Generator().manual_seed(2))
    assert n_acc.tolist() == [K] * B  # q == p: min(1, p/q) = 1
    # a guess the target gives probability 0 is never accepted (with or without q)
    bad = drafts.clone()
    bad[:, 0] = 5
    n_acc, nxt = verify_stochastic(tp, bad, torch.full((B, K, V), 1 / V), torch.full((B,), K), torch.Generator().manual_seed(3))
    assert n_acc.tolist() == [0] * B and bool((nxt != 5).all())
    n_acc, nxt = verify_stochastic(tp, bad, None, torch.full((B,), K), torch.Generator().manual_seed(3))
    assert n_acc.tolist() == [0] * B and bool((nxt != 5).all())


def test_stochastic_recovered_token_comes_from_the_residual_support():
    """After a rejection at position i the recovered token r must have p_i(r) > q_i(r)
    (the residual is zero elsewhere); with q = None it is never the rejected guess."""
    B, K = 2000, 2
    g = torch.Generator().manual_seed(5)
    tp = torch.softmax(torch.randn(B, K + 1, V, generator=g) * 1.5, -1)
    qs = torch.softmax(torch.randn(B, K, V, generator=g) * 1.5, -1)
    drafts = torch.multinomial(qs.reshape(-1, V), 1, generator=g).reshape(B, K)
    counts = torch.randint(0, K + 1, (B,), generator=g)
    n_acc, nxt = verify_stochastic(tp, drafts, qs, counts, torch.Generator().manual_seed(6))
    assert bool((n_acc <= counts).all())
    rej = (n_acc < counts).nonzero().squeeze(1)
    assert len(rej) > 100
    i = n_acc[rej]
    p_r = tp[rej, i, nxt[rej]]
    q_r = qs[rej, i, nxt[rej]]
    assert bool((p_r > q_r).all())
    n_acc, nxt = verify_stochastic(tp, drafts, None, counts, torch.Generator().manual_seed(6))
    rej = (n_acc < counts).nonzero().squeeze(1)
    assert len(rej) > 100
    assert bool((nxt[rej] != drafts[rej, n_acc[rej]]).all())


def test_stochastic_same_seed_same_result():
    B, K = 300, 3
    g = torch.Generator().manual_seed(9)
    tp = torch.softmax(torch.randn(B, K + 1, V, generator=g), -1)
    qs = torch.softmax(torch.randn(B, K, V, generator=g), -1)
    drafts = torch.multinomial(qs.reshape(-1, V), 1, generator=g).reshape(B, K)
    counts = torch.full((B,), K)
    a = verify_stochastic(tp, drafts, qs, counts, torch.Generator().manual_seed(42))
    b = verify_stochastic(tp, drafts, qs, counts, torch.Generator().manual_seed(42))
    c = verify_stochastic(tp, drafts, qs, counts, torch.Generator().manual_seed(43))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not (torch.equal(a[0], c[0]) and torch.equal(a[1], c[1]))


# ----------------------------------------------------------------------------------------
# stochastic: distribution of the first emitted token (one position)
# ----------------------------------------------------------------------------------------

N_TRIALS = 12000  # per distribution check (rows of one call); ~0.3 s each
N_BROKEN = 6000  # the broken rule is off by chi2 ~ 100s at this size


def _single_position(verify, p: torch.Tensor, q: torch.Tensor | None, seed: int, guess: int = 5, counts=None, n=N_TRIALS):
    """First emitted token over N_TRIALS rows: the draft if accepted, else the recovered one.
    Returns (first [N], accepted [N] bool, bonus-or-recovered token [N])."""
    g = torch.Generator().manual_seed(seed)
    B = n
    tp = torch.stack([p, P_BONUS])[None].expand(B, 2, V).contiguous()
    if q is None:  # deterministic guess, q one-hot
        drafts = torch.full((B, 1), guess, dtype=torch.long)
        qs = None
    else:
        drafts = torch.multinomial(q.expand(B, V), 1, replacement=True, generator=g)  # [B, 1]
        qs = q[None, None].expand(B, 1, V).contiguous()
    if counts is None:
        counts = torch.ones(B, dtype=torch.long)
    n_acc, nxt = verify(tp, drafts, qs, counts, g)
    acc = n_acc == 1
    first = torch.where(acc, drafts[:, 0], nxt)
    return first, acc, nxt


@pytest.mark.parametrize("p_name,p", [("p", P), ("p_topk", P_TOPK)])
@pytest.mark.parametrize("q_name", list(Q_CASES))
def test_first_token_distribution_equals_target(p_name, p, q_name):
    make_q = Q_CASES[q_name]
    q = None if make_q is None else make_q(p)
    guess = int(p.masked_fill(p <= 0, 2.0).argmin())  # q=None: guess the least likely token
    seed = 1000 + list(Q_CASES).index(q_name) + (100 if p_name == "p_topk" else 0)
    first, acc, nxt = _single_position(verify_stochastic, p, q, seed, guess=guess)
    res = chi2_test(histogram(first[:, None], (V,)), p, ALPHA)
    assert not res.rejected, f"first emitted token is not distributed as p ({q_name}): {res}"
    # acceptance rate is exactly sum_x min(p(x), q(x)) (q one-hot: p(guess))
    want = float(p[guess]) if q is None else float(torch.minimum(p, q).sum())
    n = len(acc)
    assert abs(float(acc.float().mean()) - want) < 4.5 * (want * (1 - want) / n) ** 0.5 + 1e-9
    # after a full accept the bonus token comes from the *next* position's p
    if int(acc.sum()) > 200:
        res = chi2_test(histogram(nxt[acc][:, None], (V,)), P_BONUS, ALPHA)
        assert not res.rejected, f"bonus token is not distributed as p at position K: {res}"


def test_first_token_distribution_with_mixed_counts():
    """Rows with count 0 sample p directly; rows with count 1 go through rejection."""
    q = torch.full((V,), 1.0 / V)
    counts = torch.arange(N_TRIALS) % 2
    first, acc, _ = _single_position(verify_stochastic, P, q, seed=77, counts=counts)
    assert not bool(acc[counts == 0].any())
    for c in (0, 1):
        res = chi2_test(histogram(first[counts == c][:, None], (V,)), P, ALPHA)
        assert not res.rejected, f"count {c}: {res}"


@pytest.mark.parametrize("q_name", ["q_uniform", "q_peaked_elsewhere", "q_none"])
def test_broken_rule_is_rejected_by_the_same_check(q_name):
    """Recovered token from p instead of the residual: the check must fail."""
    make_q = Q_CASES[q_name]
    q = None if make_q is None else make_q(P)
    guess = 0  # q=None: guess the *most* likely token, so rejections bias towards it
    first, _, _ = _single_position(broken_verify_stochastic, P, q, seed=2024, guess=guess, n=N_BROKEN)
    res = chi2_test(histogram(first[:, None], (V,)), P, ALPHA)
    assert res.rejected, f"the broken verifier passed the check: {res}"


# ----------------------------------------------------------------------------------------
# stochastic: joint of the first two emitted tokens over a two-position chain
# ----------------------------------------------------------------------------------------


def _chain_tables(seed: int):
    g = torch.Generator().manual_seed(seed)
    p1 = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    p2 = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)  # p2[x] = p(. | x)
    p2[:, 4] = 0.0  # a token the target never emits second (as after top-k)
    p2 = p2 / p2.sum(-1, keepdim=True)
    q1 = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    q2 = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)
    return p1, p2, q1, q2


def _two_tokens(verify, p1, p2, q1, q2, deterministic: bool, seed: int, n: int = N_TRIALS):
    """Emulate the engine: one K=2 chain step, and for rows that stopped after one token a
    second step (K=1) from the context extended by that token. Returns [N, 2]."""
    g = torch.Generator().manual_seed(seed)
    B = n
    if deterministic:  # fixed guesses, q one-hot
        d1 = torch.full((B,), 5, dtype=torch.long)
        d2 = (d1 + 1) % V
        qs = None
    else:
        d1 = torch.multinomial(q1.expand(B, V), 1, replacement=True, generator=g).squeeze(1)
        d2 = torch.multinomial(q2[d1], 1, generator=g).squeeze(1)
        qs = torch.stack([q1.expand(B, V), q2[d1]], 1)  # [B, 2, V]
    tp = torch.stack([p1.expand(B, V), p2[d1], torch.full((B, V), 1.0 / V)], 1)  # [B, 3, V]
    n_acc, nxt = verify(tp, torch.stack([d1, d2], 1), qs, torch.full((B,), 2), g)
    first = torch.where(n_acc >= 1, d1, nxt)
    second = torch.where(n_acc == 2, d2, nxt)
    redo = (n_acc == 0).nonzero().squeeze(1)
    if len(redo):
        x = first[redo]
        R = len(redo)
        if deterministic:
            e = (x + 2) % V
            qs2 = None
        else:
            e = torch.multinomial(q2[x], 1, generator=g).squeeze(1)
            qs2 = q2[x][:, None]
        tp2 = torch.stack([p2[x], torch.full((R, V), 1.0 / V)], 1)
        a2, n2 = verify(tp2, e[:, None], qs2, torch.ones(R, dtype=torch.long), g)
        second[redo] = torch.where(a2 == 1, e, n2)
    return torch.stack([first, second], 1), n_acc


@pytest.mark.parametrize("deterministic", [False, True], ids=["q_sampled", "q_none"])
def test_two_position_joint_equals_target(deterministic):
    p1, p2, q1, q2 = _chain_tables(31)
    pairs, n_acc = _two_tokens(verify_stochastic, p1, p2, q1, q2, deterministic, seed=32 + deterministic)
    # every branch was exercised: rejected at 1, rejected at 2, full accept
    assert all(int((n_acc == a).sum()) > 300 for a in (0, 1, 2)), torch.bincount(n_acc, minlength=3)
    joint = p1[:, None] * p2  # p1(x) p2(y|x)
    res = chi2_test(histogram(pairs, (V, V)), joint, ALPHA)
    assert not res.rejected, f"joint of the first two tokens is not p1(x) p2(y|x): {res}"


def test_two_position_joint_broken_rule_is_rejected():
    p1, p2, q1, q2 = _chain_tables(31)
    pairs, _ = _two_tokens(broken_verify_stochastic, p1, p2, q1, q2, False, seed=33, n=N_BROKEN)
    res = chi2_test(histogram(pairs, (V, V)), p1[:, None] * p2, ALPHA)
    assert res.rejected, f"the broken verifier passed the two-token check: {res}"


# ----------------------------------------------------------------------------------------
# the odds the cost model learns a sampled row's acceptance from (core.step.held_odds)
# ----------------------------------------------------------------------------------------

def _rates_within(empirical: float, expected: float, n: int) -> bool:
    """An observed frequency over n trials within 5 standard errors of its expected rate."""
    return abs(empirical - expected) <= 5 * max(expected * (1 - expected), 1e-4) ** 0.5 / n ** 0.5


def test_held_odds_are_what_verification_accepts_a_chain_with():
    """Each guess's odds are the target's probability of it at its parent's position (the guess
    before it): read from the table here, and the frequency with which sample and compare (one-hot
    guesses) or the rejection rule (guesses drawn from q) accepts it given its parent held."""
    from specdec.core.step import held_odds

    p1, p2 = P, P_BONUS
    B = N_TRIALS
    tp = torch.stack([p1, p2, P])[None].expand(B, 3, V).contiguous()
    guesses = torch.tensor([[1, 4]]).expand(B, 2).contiguous()
    counts = torch.full((B,), 2, dtype=torch.long)
    odds = held_odds(tp, guesses, None, None, counts)
    assert odds[0] == pytest.approx([float(p1[1]), float(p2[4])])
    n_acc, _ = verify_stochastic(tp, guesses, None, counts, torch.Generator().manual_seed(5),
                                 positions=[10] * B, rows=list(range(B)))
    first = (n_acc >= 1).double()
    assert _rates_within(float(first.mean()), odds[0][0], B)
    assert _rates_within(float((n_acc == 2).double().sum() / first.sum()), odds[0][1], int(first.sum()))
    # the odds taken at the guess's own position (off by one) are not what verification accepts
    assert not _rates_within(float(first.mean()), float(p2[1]), B)

    # a guess drawn from q: the rejection rule accepts it with sum(min(p, q)) on average over q
    q = _confidently_wrong(p1)
    g = torch.Generator().manual_seed(6)
    drafts = torch.multinomial(q.expand(B, V), 1, replacement=True, generator=g)
    qs = q[None, None].expand(B, 1, V).contiguous()
    one = torch.ones(B, dtype=torch.long)
    odds_q = held_odds(tp[:, :2], drafts, None, qs, one)
    assert odds_q[0] == pytest.approx([float(torch.minimum(p1, q).sum())])
    n_acc, _ = verify_stochastic(tp[:, :2], drafts, qs, one, g)
    assert _rates_within(float((n_acc == 1).double().mean()), odds_q[0][0], B)


def test_held_odds_of_a_tree_give_its_expected_path():
    """A tree of one-hot nodes (two children of the root, a grandchild under the first): each
    node's odds are the target's probability of its token at its parent's position, and the
    expected accepted nodes they give (`policy.load.expected_path`) is what sample and compare
    accepts on average."""
    from specdec.core.step import held_odds
    from specdec.policy.load import expected_path
    from specdec.verify import verify_tree_stochastic

    B = N_TRIALS
    tp = torch.stack([P, P_BONUS, P_TOPK, P])[None].expand(B, 4, V).contiguous()
    tokens = torch.tensor([[0, 1, 5]]).expand(B, 3).contiguous()  # node 3 (token 5) under node 1
    parents = torch.tensor([[0, 0, 1]]).expand(B, 3).contiguous()
    counts = torch.full((B,), 3, dtype=torch.long)
    odds = held_odds(tp, tokens, parents, None, counts)
    assert odds[0] == pytest.approx([float(P[0]), float(P[1]), float(P_BONUS[5])])
    expect = expected_path(odds[0], [0, 0, 1])
    assert expect == pytest.approx(float(P[0] + P[1] + P[0] * P_BONUS[5]))
    paths, _ = verify_tree_stochastic(tp, tokens, parents, None, counts, torch.Generator().manual_seed(7),
                                      positions=[3] * B, rows=list(range(B)))
    lengths = torch.tensor([len(p) for p in paths], dtype=torch.double)
    assert abs(float(lengths.mean()) - expect) <= 5 * float(lengths.std()) / B ** 0.5
    # the tree read as a chain (node 3 under node 2) expects another length, which the same check rejects
    wrong = expected_path(held_odds(tp, tokens, torch.tensor([[0, 1, 2]]).expand(B, 3), None, counts)[0], [0, 1, 2])
    assert abs(float(lengths.mean()) - wrong) > 5 * float(lengths.std()) / B ** 0.5
