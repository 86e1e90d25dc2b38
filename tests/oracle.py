"""Independent oracles for the exactness tests (docs/design.md "Why the output is exact").

Nothing here imports the code under test except where a test explicitly needs a specdec
type to talk to the engine (the Draft/DraftContext value types, `build_native`):

- tiny random fp32 Llama models built with transformers (the reference implementation);
- exact next-token distributions from transformers' forward + transformers' own logits
  warpers (temperature, top-k, top-p), enumerated over short continuations;
- a chi-square goodness-of-fit test with the critical value computed from the regularised
  incomplete gamma function (no scipy needed), and its views of sampled 3-token continuations;
- deliberately *broken* stochastic verifiers, chain and tree (recovered token drawn from p
  instead of the residual norm(max(0, p - q))) that the distribution checks must reject;
- adversarial drafters (random / corrupted / confidently wrong guesses).
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass

import torch

from specdec.drafters.base import Drafter


@contextlib.contextmanager
def one_thread():
    """Run with one intra-op thread, then restore. The models here are tiny, so threads buy
    nothing, and on a shared 2-core machine OpenMP workers spinning against another
    process made these tests 5-10x slower and erratic."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ----------------------------------------------------------------------------------------
# chi-square
# ----------------------------------------------------------------------------------------


def chi2_critical(df: int, alpha: float) -> float:
    """x such that P(Chi2(df) > x) = alpha, by bisection on the chi-square CDF
    (the regularised lower incomplete gamma function P(df/2, x/2))."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    a = torch.tensor(df / 2.0, dtype=torch.float64)
    lo, hi = 0.0, 100.0 + 20.0 * df
    for _ in range(200):
        mid = (lo + hi) / 2
        cdf = float(torch.special.gammainc(a, torch.tensor(mid / 2.0, dtype=torch.float64)))
        if cdf < 1.0 - alpha:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@dataclass
class Chi2Result:
    stat: float
    df: int
    critical: float
    n: int
    cells: int  # cells after pooling

    @property
    def rejected(self) -> bool:
        return self.stat > self.critical

    def __str__(self) -> str:
        return f"chi2={self.stat:.2f} df={self.df} critical={self.critical:.2f} n={self.n} cells={self.cells}"


def chi2_test(counts: torch.Tensor, probs: torch.Tensor, alpha: float = 1e-3, min_expected: float = 5.0) -> Chi2Result:
    """Pearson goodness of fit of observed `counts` against the exact `probs` (same shape).

    Cells whose expected count is below `min_expected` are pooled into one cell (if that pool
    is still too small it is merged with the smallest regular cell). A count in a cell of
    probability 0 makes the statistic infinite (an impossible outcome was observed).
    """
    counts = counts.reshape(-1).to(torch.float64)
    probs = probs.reshape(-1).to(torch.float64)
    if counts.shape != probs.shape:
        raise ValueError("counts and probs differ in shape")
    s = float(probs.sum())
    if abs(s - 1.0) > 1e-6:
        raise ValueError(f"probs sum to {s}, not 1")
    n = float(counts.sum())
    if bool(((probs == 0) & (counts > 0)).any()):
        return Chi2Result(float("inf"), 1, chi2_critical(1, alpha), int(n), 0)
    expected = probs * n
    big = expected >= min_expected
    obs_cells = counts[big].tolist()
    exp_cells = expected[big].tolist()
    pool_o, pool_e = float(counts[~big].sum()), float(expected[~big].sum())
    if pool_e > 0:
        if pool_e < min_expected and exp_cells:
            i = min(range(len(exp_cells)), key=lambda j: exp_cells[j])
            obs_cells[i] += pool_o
            exp_cells[i] += pool_e
        else:
            obs_cells.append(pool_o)
            exp_cells.append(pool_e)
    if len(exp_cells) < 2:
        raise ValueError("fewer than two cells after pooling: draw more samples")
    stat = sum((o - e) ** 2 / e for o, e in zip(obs_cells, exp_cells))
    df = len(exp_cells) - 1
    return Chi2Result(stat, df, chi2_critical(df, alpha), int(n), len(exp_cells))


def histogram(samples: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """samples [N, d] of indices into `shape` -> counts tensor of `shape`."""
    samples = torch.as_tensor(samples, dtype=torch.long).reshape(-1, len(shape))
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    flat = (samples * torch.tensor(strides)[None, :]).sum(1)
    return torch.bincount(flat, minlength=int(torch.tensor(shape).prod())).reshape(shape)


# ----------------------------------------------------------------------------------------
# broken stochastic verifiers (must be caught by the distribution checks)
# ----------------------------------------------------------------------------------------


def broken_verify_stochastic(target_probs, draft_tokens, draft_probs, counts, generator, positions=None, rows=None):
    """Leviathan Alg. 1 with the classic mistake: after a rejection the recovered token is
    drawn from p itself, not from the residual norm(max(0, p - q)). Written independently of
    specdec.verify; same signature and return value (text positions ignored: Alg. 1 itself)."""
    B, K1, V = target_probs.shape
    K = K1 - 1
    n_acc = torch.zeros(B, dtype=torch.long)
    nxt = torch.zeros(B, dtype=torch.long)
    r = torch.rand(B, max(K, 1), generator=generator)
    for b in range(B):
        i = 0
        while i < int(counts[b]):
            x = int(draft_tokens[b, i])
            p = float(target_probs[b, i, x])
            q = 1.0 if draft_probs is None else float(draft_probs[b, i, x])
            if float(r[b, i]) * q < p:
                i += 1
            else:
                break
        n_acc[b] = i
        nxt[b] = torch.multinomial(target_probs[b, i], 1, generator=generator)[0]  # BUG: p, not residual
    return n_acc, nxt


def broken_tree_verify(target_probs, tokens, parents, draft_probs, counts, generator, max_depth=None, positions=None,
                       rows=None):
    """Wrong: every sibling is judged against the original p (no residual update), and the
    recovered token is sampled from p instead of the residual (text positions ignored)."""
    from specdec.verify import _tree_children

    toks, pars, cnt = tokens.tolist(), parents.tolist(), counts.tolist()
    paths, nxt = [], []
    for b in range(len(toks)):
        ch = _tree_children(pars[b], cnt[b])
        node, path = 0, []
        while True:
            p = target_probs[b, node]
            acc = None
            for c in ch[node] if max_depth is None or len(path) < max_depth[b] else []:
                x = toks[b][c - 1]
                qx = 1.0 if draft_probs is None else float(draft_probs[b, c - 1, x])
                if float(torch.rand((), generator=generator)) * qx < float(p[x]):
                    acc = c
                    break
            if acc is None:
                nxt.append(int(torch.multinomial(p, 1, generator=generator)[0]))
                break
            path.append(acc)
            node = acc
        paths.append(path)
    return paths, torch.tensor(nxt)


# ----------------------------------------------------------------------------------------
# chi-square views of sampled continuations
# ----------------------------------------------------------------------------------------


def chi2_views(samples: dict, params: dict, exact, alpha: float = 1e-3) -> list:
    """[(label, Chi2Result)]: chi-square tests of sampled 3-token continuations (context -> [N, 3]
    tensor of tokens) against `exact(ctx, temperature, top_k, top_p)`, the exact joint [V, V, V]
    of the three tokens: the pairs (x1, x2) and (x2, x3) and the whole triple, per context, at a
    family-wise level `alpha`."""
    alpha = alpha / (3 * len(samples))
    out = []
    for i, (ctx, s) in enumerate(samples.items()):
        joint = exact(ctx, params["temperature"], params.get("top_k", 0), params.get("top_p", 1.0))
        for label, obs, probs in (("x1,x2", s[:, :2], joint.sum(2)), ("x2,x3", s[:, 1:], joint.sum(0)), ("all", s, joint)):
            out.append((f"context {i} {label}", chi2_test(histogram(obs, tuple(probs.shape)), probs, alpha)))
    return out


def chi2_against(hf, out: dict, params: dict) -> list:
    """chi2_views of sampled 3-token continuations (context -> list of token triples) against the
    exact distributions of the transformers model `hf`."""
    import functools

    exact = functools.lru_cache(maxsize=None)(lambda c, t, k, p: exact_joint(hf, list(c), 3, t, k, p))
    return chi2_views({c: torch.tensor(v) for c, v in out.items()}, params, exact)


# ----------------------------------------------------------------------------------------
# tiny transformers models
# ----------------------------------------------------------------------------------------


def tiny_hf_llama(seed: int, vocab: int = 64, hidden: int = 32, layers: int = 2, logit_scale: float = 1.0):
    """A random fp32 Llama (transformers), every parameter re-drawn so logits are O(1..3)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    hf = LlamaForCausalLM(cfg).to(torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-1]
                scale = logit_scale if name.startswith("lm_head") else 1.0
                p.copy_(scale * torch.randn(p.shape, generator=g) / fan_in**0.5)
    hf.generation_config.eos_token_id = None
    hf.generation_config.bos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf.eval()


def native_of(hf):
    from specdec.models.llama import build_native

    return build_native(hf.config, hf.state_dict())


@torch.no_grad()
def hf_last_logits(hf, contexts: list[list[int]]) -> torch.Tensor:
    """transformers' logits at the last position of each (equal-length) context [N, V]."""
    toks = torch.tensor(contexts, dtype=torch.long)
    return hf(input_ids=toks, use_cache=False).logits[:, -1].float()


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' plain greedy continuation (the oracle), prompt excluded."""
    ids = torch.tensor([prompt], dtype=torch.long)
    out = hf.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def greedy_margins(hf, prompt: list[int], continuation: list[int]) -> float:
    """Smallest gap between the top-2 logits along a greedy trajectory (near-ties would make
    a token-for-token comparison between two fp32 implementations ill-posed)."""
    seq = torch.tensor([prompt + continuation], dtype=torch.long)
    logits = hf(input_ids=seq, use_cache=False).logits[0, len(prompt) - 1 : -1].float()
    top2 = logits.topk(2, dim=-1).values
    return float((top2[:, 0] - top2[:, 1]).min())


def hf_warp(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Warped probabilities using transformers' own logits processors, in generate's order."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = logits.float()
    dummy_ids = torch.zeros(scores.shape[0], 1, dtype=torch.long)
    scores = TemperatureLogitsWarper(temperature)(dummy_ids, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(dummy_ids, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(dummy_ids, scores)
    return scores.softmax(-1)


@torch.no_grad()
def exact_joint(hf, ctx: list[int], n: int, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Exact target distribution of the next n tokens after ctx: tensor [V]*n (fp64),
    P(x1..xn) = prod_i warp(p(x_i | ctx, x_<i)), enumerating every prefix."""
    V = hf.config.vocab_size
    joint = torch.ones((), dtype=torch.float64)
    for depth in range(n):
        prefixes = list(itertools.product(range(V), repeat=depth))
        cond = hf_warp(hf_last_logits(hf, [ctx + list(pre) for pre in prefixes]), temperature, top_k, top_p)
        cond = cond.to(torch.float64).reshape(*([V] * depth), V)
        joint = joint[..., None] * cond
    return joint / joint.sum()


# ----------------------------------------------------------------------------------------
# adversarial drafters (implement the engine's drafter interface)
# ----------------------------------------------------------------------------------------


def _draft(tokens: list[list[int]], probs: torch.Tensor | None):
    from specdec.drafters.base import Draft

    B = len(tokens)
    N = max((len(t) for t in tokens), default=0)
    out = torch.zeros(B, N, dtype=torch.long)
    for b, t in enumerate(tokens):
        out[b, : len(t)] = torch.tensor(t, dtype=torch.long)
    counts = torch.tensor([len(t) for t in tokens], dtype=torch.long)
    return Draft(out, counts, probs)


class _Base(Drafter):
    may_skip = False  # every step proposes: the checks want every step verified

    def __init__(self) -> None:
        self.begun = 0
        self.commits: list[list[int]] = []

    def begin(self, prompts, params, max_len) -> None:
        self.begun += 1
        self.rows = len(prompts)

    def commit(self, num_accepted, paths=None) -> None:
        self.commits.append(list(num_accepted))

    def add_row(self, max_len, prompt=None) -> None:
        self.rows += 1

    def keep_rows(self, rows) -> None:
        self.rows = len(rows)


class RandomGuessDrafter(_Base):
    """Deterministic-guess drafter (probs None) whose guesses are wrong on purpose.

    mode "random": uniformly random tokens, a random count in 0..max_tokens per row.
    mode "corrupt": the oracle's true greedy continuation (looked up in `truth`, a list of
    full sequences prompt + greedy continuation) for a random number of tokens, then one
    wrong token, then random tokens; exercises every accepted count, ragged across rows.
    A context that is not on any oracle trajectory gets random guesses.
    """

    def __init__(self, vocab: int, seed: int = 0, mode: str = "random", truth=None) -> None:
        super().__init__()
        self.vocab, self.mode, self.truth = vocab, mode, truth or []
        self.g = torch.Generator().manual_seed(seed)
        self.proposals = 0

    def _rand(self, hi: int) -> int:
        return int(torch.randint(0, hi, (1,), generator=self.g))

    def _true_next(self, row: list[int], n: int) -> list[int]:
        for seq in self.truth:
            if len(seq) >= len(row) + n and seq[: len(row)] == row:
                return seq[len(row) : len(row) + n]
        return [self._rand(self.vocab) for _ in range(n)]

    def propose(self, ctx, max_tokens: int):
        assert len(ctx.tokens) == self.rows, "engine and drafter disagree on the batch rows"
        self.proposals += 1
        guesses = []
        for row in ctx.tokens:
            n = self._rand(max_tokens + 1)
            if self.mode == "random":
                guesses.append([self._rand(self.vocab) for _ in range(n)])
                continue
            truth = self._true_next(list(row), n)
            good = self._rand(n + 1)
            g = truth[:good]
            if good < n:
                g.append((truth[good] + 1 + self._rand(self.vocab - 1)) % self.vocab)  # != truth
                g += [self._rand(self.vocab) for _ in range(n - good - 1)]
            guesses.append(g)
        return _draft(guesses, None)


class UniformDrafter(_Base):
    """Samples guesses from q = uniform over the vocabulary and reports that q."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab

    def propose(self, ctx, max_tokens: int):
        assert len(ctx.tokens) == self.rows, "engine and drafter disagree on the batch rows"
        B, V = len(ctx.tokens), self.vocab
        toks = torch.randint(0, V, (B, max_tokens), generator=ctx.generator)
        probs = torch.full((B, max_tokens, V), 1.0 / V)
        return _draft(toks.tolist(), probs)


class ConfidentlyWrongDrafter(_Base):
    """q puts `mass` on the possible token (nonzero warped target probability) that the
    *target* finds least likely, and spreads the rest uniformly over the other tokens;
    guesses are sampled from q, as the rule requires. The target's view comes from
    transformers, per context, without a cache."""

    def __init__(self, hf, temperature: float, top_k: int = 0, top_p: float = 1.0, mass: float = 0.99) -> None:
        super().__init__()
        self.hf, self.warp_args, self.mass = hf, (temperature, top_k, top_p), mass
        self.V = hf.config.vocab_size

    def _q(self, contexts: list[list[int]]) -> torch.Tensor:
        uniq = list(dict.fromkeys(tuple(c) for c in contexts))  # rows often share a context
        pu = torch.empty(len(uniq), self.V)
        by_len: dict[int, list[int]] = {}
        for i, c in enumerate(uniq):
            by_len.setdefault(len(c), []).append(i)
        for idx in by_len.values():  # one transformers forward per context length
            pu[idx] = hf_warp(hf_last_logits(self.hf, [list(uniq[i]) for i in idx]), *self.warp_args)
        where = {c: i for i, c in enumerate(uniq)}
        p = pu[[where[tuple(c)] for c in contexts]]
        # the least likely token that is still possible under p: a wrong guess that still
        # gets accepted now and then (a q on an impossible token would always be rejected)
        masked = p.masked_fill(p <= 0, float("inf"))
        worst = masked.argmin(-1)
        q = torch.full_like(p, (1.0 - self.mass) / (self.V - 1))
        q.scatter_(1, worst[:, None], self.mass)
        return q

    def propose(self, ctx, max_tokens: int):
        assert len(ctx.tokens) == self.rows, "engine and drafter disagree on the batch rows"
        rows = [list(t) for t in ctx.tokens]
        toks, probs = [], []
        for _ in range(max_tokens):
            q = self._q(rows)
            x = torch.multinomial(q, 1, generator=ctx.generator).squeeze(1)
            toks.append(x)
            probs.append(q)
            for r, t in zip(rows, x.tolist()):
                r.append(t)
        if not toks:
            return _draft([[] for _ in rows], None)
        return _draft(torch.stack(toks, 1).tolist(), torch.stack(probs, 1))


class TreeDrafter(_Base):
    """Proposes token trees (Draft.parents) built from an independent draft model run by
    transformers without a cache, per node. `branching[d]` children per node at depth d.

    mode "iid": children are i.i.d. samples of the draft's warped q at their parent (the
      same token may appear twice under one parent), probs carry that q per node;
    mode "topk": children are the draft's top tokens at their parent, deterministic
      (probs None), so sibling tokens differ; greedy-mode trees always use this;
    mode "corrupt": like "topk" (draft with the target itself) but at every node the
      best child is left out at every third node expanded and the others come in reverse order,
      so the right token is often a later sibling or missing: accepted paths of every
      length occur; the same token also appears under two different parents.
    """

    def __init__(self, hf, branching=(2, 2), mode: str = "iid", warp_args=(1.0, 0, 1.0)) -> None:
        super().__init__()
        self.hf, self.branching, self.mode, self.warp_args = hf, tuple(branching), mode, warp_args
        self.max_nodes = 0
        n = 1
        for b in self.branching:
            n *= b
            self.max_nodes += n
        self.paths_seen: list[list[list[int]]] = []
        self.nodes_expanded = 0

    def _q(self, seqs: list[list[int]], greedy: bool) -> torch.Tensor:
        logits = hf_last_logits(self.hf, seqs)
        return torch.softmax(logits.float(), -1) if greedy else hf_warp(logits, *self.warp_args)

    def propose(self, ctx, max_tokens: int):
        from specdec.drafters.base import Draft

        assert len(ctx.tokens) == self.rows
        greedy = ctx.params.greedy
        trees, probs = [], []
        for row in ctx.tokens:
            toks, pars, qs = [], [], []
            frontier = [(0, list(row))]  # (node, sequence ending in that node's token)
            for depth, b in enumerate(self.branching[: max(0, max_tokens)]):
                nxt = []
                for node, seq in frontier:
                    q = self._q([seq], greedy)[0]
                    if self.mode == "iid" and not greedy:
                        kids = torch.multinomial(q, b, replacement=True, generator=ctx.generator).tolist()
                    else:
                        kids = q.topk(b).indices.tolist()
                        if self.mode == "corrupt":
                            ranked = q.topk(b + 1).indices.tolist()
                            self.nodes_expanded += 1
                            drop = self.nodes_expanded % 3 == 0
                            kids = (ranked[1:] if drop else ranked[:b])[::-1]
                    for x in kids:
                        toks.append(int(x))
                        pars.append(node)
                        qs.append(q if (self.mode == "iid" and not greedy) else None)
                        nxt.append((len(toks), seq + [int(x)]))
                frontier = nxt
            trees.append((toks, pars))
            probs.append(qs)
        B, N = len(trees), max(len(t) for t, _ in trees)
        tokens = torch.zeros(B, N, dtype=torch.long)
        parents = torch.zeros(B, N, dtype=torch.long)
        for b, (t, p) in enumerate(trees):
            tokens[b, : len(t)] = torch.tensor(t, dtype=torch.long)
            parents[b, : len(p)] = torch.tensor(p, dtype=torch.long)
        P = None
        if self.mode == "iid" and not greedy and N:
            V = self.hf.config.vocab_size
            P = torch.zeros(B, N, V)
            for b, qs in enumerate(probs):
                for i, q in enumerate(qs):
                    P[b, i] = q
        return Draft(tokens, torch.tensor([len(t) for t, _ in trees], dtype=torch.long), P, parents)

    def commit(self, num_accepted, paths=None) -> None:
        assert paths is not None and [len(p) for p in paths] == list(num_accepted)
        self.commits.append(list(num_accepted))
        self.paths_seen.append(paths)
