"""Logits -> warped probabilities, and seeded token choice.

The warping order follows transformers' `generate`: temperature, then top-k, then top-p,
then min-p. The same `warp` is applied to the target's and the draft's logits, so that
speculative verification compares like with like (docs/design.md: p and q after the same
warping). Greedy (temperature 0) is argmax and never calls `warp`.

All randomness comes from an explicit `torch.Generator`. The target's tokens are sampled with
one uniform number per text position (`position_uniforms`: a hash of the generator's seed, the
row and the position), by inverse transform (`sample`): the token at a position then depends
only on the target's distribution there and that number, not on how many tokens earlier steps
committed at once, so speculative decoding with deterministic guesses commits exactly the text
plain sampling commits with the same seed (verify.py). This module knows nothing about models
or tokenizers.
"""

from __future__ import annotations

import math

import torch

from .kernels import loaded_rowstable_ops
from .types import SamplingParams


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [..., V] (fp32) after temperature / top-k / top-p / min-p."""
    if params.greedy:
        raise ValueError("warp() is for sampling; greedy decoding takes the argmax")
    x = _scaled(logits, params.temperature)
    V = x.shape[-1]
    if 0 < params.top_k < V:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=False)
        cum = sorted_x.softmax(-1).cumsum(-1)
        # drop the low tail whose total mass is <= 1 - top_p; the top token always stays
        drop_sorted = cum <= (1.0 - params.top_p)
        drop_sorted[..., -1] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    probs = x.softmax(-1)
    if params.min_p > 0.0:
        top = probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < params.min_p * top, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


# below this temperature, logits / T can overflow float32 (|logit| 100 at T 1e-37), or T itself
# round to 0 in float32: the logits are shifted to max 0 first and divided in float64
SMALL_TEMPERATURE = 1e-4


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature in float32, finite wherever the logits are: at tiny temperatures the
    row's maximum becomes 0 and every other logit a large negative number (or -inf), so the
    softmax is the limit distribution (one-hot on the argmax, shared among exact ties) instead
    of inf - inf = NaN. Softmax is unchanged by the shift; the usual path stays as it was."""
    if temperature >= SMALL_TEMPERATURE:
        return logits.float() / temperature
    x = logits.double()
    return ((x - x.amax(dim=-1, keepdim=True)) / temperature).float()


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit words whose outputs pass as independent."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_uniforms(generator: torch.Generator | None, rows: list[int], positions: list[int]) -> torch.Tensor:
    """Uniform numbers in [0, 1) (float64 [n]), one per (row, position) pair: a hash of the
    generator's seed (`initial_seed`: the request's seed, or the random seed of an unseeded
    generator), the row's key and the text position. The same seed, row and position give the
    same number whatever else the step holds, which is what makes seeded speculative sampling
    commit plain sampling's text (module docstring)."""
    seed = (generator.initial_seed() if generator is not None else 0) & _MASK64
    out = []
    for row, pos in zip(rows, positions):
        x = _mix64(seed ^ _mix64((int(row) * 0x9E3779B97F4A7C15 + _mix64(int(pos) + 0x632BE59BD9B4E019)) & _MASK64))
        out.append((x >> 11) * 2.0**-53)
    return torch.tensor(out, dtype=torch.float64)


def sample(probs: torch.Tensor, generator: torch.Generator | None, uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row from probabilities [..., V] (non-negative, not necessarily normalised)
    -> [...], by inverse transform: one uniform u per row, the first token whose running sum
    (float64) exceeds u times the row's total. The same distribution as `torch.multinomial`,
    which on a CPU draws V exponentials per call (about 5 ms for a 49k vocabulary, as long as a
    decoding step of the default model) where this takes a fraction of a millisecond. A row
    without positive finite mass raises ValueError, as multinomial raises. `uniforms` (one per
    row, float64) replaces the generator's draws (`position_uniforms`)."""
    V = probs.shape[-1]
    rows = probs.reshape(-1, V).double()
    # checked through the sums (a NaN or inf reaches them) and the minimum: a few microseconds,
    # where isfinite() over the rows takes a millisecond
    sums = rows.sum(-1).tolist()
    if not all(0 < x < math.inf for x in sums) or float(probs.min()) < 0:
        raise ValueError("invalid probability distribution: every row needs non-negative, finite "
                         "probabilities with a positive sum")
    cum = rows.cumsum(-1)
    total = cum[:, -1:]
    if uniforms is None:
        u = torch.rand(rows.shape[0], 1, generator=generator, dtype=torch.float64, device=probs.device)
    else:
        u = uniforms.reshape(-1, 1).to(device=probs.device, dtype=torch.float64)
    idx = torch.searchsorted(cum, u * total, right=True)  # first token whose running sum exceeds u * total
    if bool((idx >= V).any()):  # u * total rounded up to the total itself: the last token with mass
        idx = torch.minimum(idx, (cum < total).sum(-1, keepdim=True))
    return idx.reshape(probs.shape[:-1])


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) (the first index of each row's maximum, or of its first NaN): on the kernels'
    argmax_last where a model loaded them and x is a float32 CPU tensor without autograd (torch's
    reduction took ~62 us a 49152-wide row, once per verified position of every step), else torch's."""
    ops = loaded_rowstable_ops()
    if ops is not None and x.dtype == torch.float32 and x.device.type == "cpu" and not x.requires_grad \
            and x.dim() >= 1 and x.shape[-1] > 0 and hasattr(ops, "argmax_last"):
        return ops.argmax_last(x)
    return x.argmax(-1)


def choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           rows: list[int] | None = None, positions: list[int] | None = None) -> torch.Tensor:
    """The next token per row from logits [B, V] -> [B]: argmax if greedy, else a sample; with
    `positions` (each row's text position of the token chosen) and `rows` (each row's key), with
    the uniforms `position_uniforms` gives those."""
    if params.greedy:
        return argmax(logits)
    uniforms = None if positions is None else position_uniforms(generator, rows, positions)
    return sample(warp(logits, params), generator, uniforms)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(int(seed))
    return g


def draw(scores: torch.Tensor, params, generator, subset: torch.Tensor | None, vocab_size: int):
    """One draft step from scores [B, S] (over `subset` ids if given): (token ids [B], q [B, V]
    padded to the target's vocabulary, or None for greedy argmax guesses)."""
    if params.greedy:
        idx, q = argmax(scores), None
    else:
        q_head = warp(scores, params)  # scores over the subset warp like the full vocabulary with -inf outside it
        idx = sample(q_head, generator)
        q = torch.zeros(scores.shape[0], vocab_size)
        if subset is None:
            q[:, : q_head.shape[-1]] = q_head
        else:
            q[:, subset] = q_head
    return (subset[idx] if subset is not None else idx), q
