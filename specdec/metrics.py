"""Aggregate speculative-decoding figures over requests.

alpha = accepted / proposed drafts; tau = tokens committed per target decode forward
(the recovered/bonus token included, the prefill's first token excluded); per-position
acceptance = share of drafts at depth i that were accepted; draft cost c = time to draft
one token / time of one target decode forward with its verification.

Rows of one engine batch share their wall time (stats.batch tells which batch a row was
in): a batch's times are those of its longest-living row, since rows leave a batch but
never join one. This module only does arithmetic over RequestStats.
"""

from __future__ import annotations

from collections import defaultdict

from .types import GenerationResult


def summarize(results: list[GenerationResult]) -> dict:
    st = [r.stats for r in results]
    batches = defaultdict(list)
    for s in st:
        batches[s.batch].append(s)

    def batch_total(field: str) -> float:
        return sum(max(getattr(s, field) for s in group) for group in batches.values())

    new = sum(s.new_tokens for s in st)
    row_forwards = sum(s.target_forwards for s in st)
    proposed = sum(s.proposed for s in st)
    accepted = sum(s.accepted for s in st)
    depth = max((len(s.proposed_by_pos) for s in st), default=0)
    prop_pos = [sum(s.proposed_by_pos[i] for s in st if i < len(s.proposed_by_pos)) for i in range(depth)]
    acc_pos = [sum(s.accepted_by_pos[i] for s in st if i < len(s.accepted_by_pos)) for i in range(depth)]
    decode_s, draft_s, verify_s = batch_total("decode_s"), batch_total("draft_s"), batch_total("verify_s")
    steps = batch_total("target_forwards")
    mean_k = proposed / row_forwards if row_forwards else 0.0
    cost = (draft_s / steps / mean_k) / (verify_s / steps) if steps and mean_k and verify_s else 0.0
    return {
        "requests": len(st),
        "prompt_tokens": sum(s.prompt_tokens for s in st),
        "new_tokens": new,
        "prefill_s": batch_total("prefill_s"),
        "decode_s": decode_s,
        "tokens_per_s": new / decode_s if decode_s > 0 and steps else 0.0,  # 0: no decode step ran
        "target_forwards": int(steps),
        "proposed": proposed,
        "accepted": accepted,
        "alpha": accepted / proposed if proposed else 0.0,
        "tau": (new - len(st)) / row_forwards if row_forwards else 0.0,
        "acceptance_by_pos": [a / p if p else 0.0 for a, p in zip(acc_pos, prop_pos)],
        "draft_s": draft_s,
        "verify_s": verify_s,
        "draft_cost": cost,
        "plain_steps": _summed([s.plain_steps for s in st]),
        "sources": {name: dict(zip(("proposed", "accepted"), v)) for name, v in _summed([s.sources for s in st]).items()},
    }


def _summed(dicts: list[dict]) -> dict:
    """Values summed by key (numbers, or lists of numbers element-wise)."""
    out: dict = {}
    for d in dicts:
        for key, v in d.items():
            if isinstance(v, list):
                old = out.get(key, [0] * len(v))
                out[key] = [a + b for a, b in zip(old, v)]
            else:
                out[key] = out.get(key, 0) + v
    return out
