"""metrics.summarize over the results of several engines: each call's batch keeps its own time."""

from __future__ import annotations

from helpers import lookup, prompts, target
from specdec.engine import Engine
from specdec.metrics import summarize
from specdec.types import SamplingParams


def test_results_of_several_engines_sum_their_decode_times():
    """Benchmarks build a fresh engine per call and summarize every call's results together. Rows of
    one batch share their wall time (summarize takes a batch's longest row), so two engines' batches
    must not share a number: the summary's decode time is then the sum of each call's."""
    tg, params = target(), SamplingParams(max_new_tokens=6)
    calls = [Engine(tg.model, lookup(), k=3).generate(prompts()[:2], params) for _ in range(3)]
    numbers = [{r.stats.batch for r in call} for call in calls]
    assert all(len(n) == 1 for n in numbers) and len(set.union(*numbers)) == 3, numbers  # one per batch
    per_call = [summarize(call)["decode_s"] for call in calls]
    assert all(s > 0 for s in per_call)
    together = summarize([r for call in calls for r in call])["decode_s"]
    assert abs(together - sum(per_call)) < 1e-9, (together, per_call)
