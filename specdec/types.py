"""Plain value types shared by the engine, the CLI and (later) the drafters.

Shape letters used across the package:
    B batch rows, T tokens in one forward, K draft length, N draft/tree nodes,
    S cache slots, V vocabulary, D hidden size.

This module knows nothing about models, tokenizers or files.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class SpecdecError(Exception):
    """An error the user can fix; the CLI prints its message as one line."""


SEED_LIMIT = 2**63  # torch generators take 64-bit seeds; batches and samples add small offsets

# most guesses (-k) and tree nodes a step may verify: with the pending token and auto's grafted
# lookup a step stays within the steps the kernels verify bit for bit as plain decoding computes
# them (models/llama.py ATTEND_MAX_T = 64 tokens)
MAX_GUESSES = 48


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each token. temperature == 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    min_p: float = 0.0  # 0.0 = off
    seed: int | None = None
    max_new_tokens: int = 256

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature < float("inf"):
            raise SpecdecError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SpecdecError(f"top-k must be a whole number >= 0 (0 = off), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise SpecdecError(f"top-p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.min_p, (int, float)) and 0.0 <= self.min_p < 1.0):
            raise SpecdecError(f"min-p must be in [0, 1), got {self.min_p!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and -SEED_LIMIT <= self.seed < SEED_LIMIT):
            raise SpecdecError(f"seed must be a whole number in [-2**63, 2**63), got {self.seed!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise SpecdecError(f"max-new-tokens must be >= 1, got {self.max_new_tokens!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class RequestStats:
    """Per-row figures from one generate call (speculative fields stay 0 without a drafter).

    alpha (acceptance rate) = accepted / proposed; tau (mean accepted length) = tokens
    committed per decode forward of the target, counting the recovered/bonus token. The
    first token comes from the prefill and is not counted in tau.
    """

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache instead of computed (prefix_cache.py)
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    target_forwards: int = 0  # decode forwards of the target (prefill excluded)
    proposed: int = 0
    accepted: int = 0
    proposed_by_pos: list[int] = field(default_factory=list)  # [i] = drafts proposed at depth i+1
    accepted_by_pos: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    finish_reason: str = ""  # "eos" | "length" | "stop"
    batch: int = 0  # which engine batch the row ran in (rows of a batch share wall time)
    sources: dict = field(default_factory=dict)  # draft source name -> [guesses verified, held]
    # steps this row decoded without guesses, by why: cost (none paid), guard (the batch guard),
    # nothing (no source had a guess), warming, probe, row (the step drafted for other rows only)
    plain_steps: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        """Decode rate; 0 when no decode step ran (only the prefill's token came out)."""
        return self.new_tokens / self.decode_s if self.decode_s > 0 and self.target_forwards else 0.0

    @property
    def alpha(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tau(self) -> float:
        committed = self.new_tokens - 1  # the prefill produced the first token
        return committed / self.target_forwards if self.target_forwards else 0.0

    def add_position_counts(self, proposed: int, accepted: int) -> None:
        for name, n in (("proposed_by_pos", proposed), ("accepted_by_pos", accepted)):
            hist = getattr(self, name)
            while len(hist) < proposed:
                hist.append(0)
            for i in range(n):
                hist[i] += 1

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "new_tokens": self.new_tokens,
            "prefill_s": round(self.prefill_s, 6),
            "decode_s": round(self.decode_s, 6),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "target_forwards": self.target_forwards,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "alpha": round(self.alpha, 4),
            "tau": round(self.tau, 4),
            "accepted_by_pos": list(self.accepted_by_pos),
            "proposed_by_pos": list(self.proposed_by_pos),
            "draft_s": round(self.draft_s, 6),
            "verify_s": round(self.verify_s, 6),
            "finish_reason": self.finish_reason,
            "sources": {name: {"proposed": p, "accepted": a} for name, (p, a) in self.sources.items()},
            "plain_steps": dict(self.plain_steps),
        }


@dataclass
class GenerationResult:
    """What one row produced: token ids (without the prompt) and its stats."""

    tokens: list[int] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)
