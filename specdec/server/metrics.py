"""/metrics in Prometheus' text format, through `prometheus_client`.

Each app has its own registry (several apps may live in one process: tests, Ray replicas).
The unit is the batcher's request: one choice of an HTTP request (one prompt and one sample of
`n`), so a request with n = 2 or with three batched prompts counts 2 or 3 times, in the
counters and in the histograms alike. The batcher's counters and gauges are read from
`ContinuousBatcher.stats()` (a `BatcherStats`) at scrape time by a collector, so they are always
the batcher's own figures. Requests balance: requests_total = finished + cancelled + failed + running
(batch_size) + queued (queue_size). The latency histograms observe each finished choice once,
as it ends (`observe_finished`), so specdec_request_seconds_count equals
specdec_requests_finished_total, and the time-to-first-token and per-token histograms count
the finished choices that generated a token (all but scoring-only ones).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# (metric name without the _total suffix, BatcherStats attribute, help)
COUNTERS = (
    ("specdec_requests", "requests", "requests submitted to the batcher"),
    ("specdec_requests_finished", "finished", "requests that ended normally (stop, length, end of text)"),
    ("specdec_requests_cancelled", "cancelled", "requests cancelled (client gone, timed out) before they ended"),
    ("specdec_requests_failed", "failed", "requests that failed alone (an error in their own row) or at shutdown"),
    ("specdec_generated_tokens", "tokens", "tokens generated"),
    ("specdec_prompt_tokens", "prompt_tokens", "prompt tokens prefilled"),
    ("specdec_prompt_tokens_cached", "cached_tokens", "prompt tokens taken from the prefix cache instead of computed"),
    ("specdec_draft_tokens_proposed", "proposed", "guessed tokens verified by the target"),
    ("specdec_draft_tokens_accepted", "accepted", "guessed tokens the target accepted"),
    ("specdec_steps", "steps", "decoding steps"),
)
# (metric name without the _total suffix, BatcherStats dict attribute, its label, help)
LABELLED = (
    ("specdec_source_rows", "source_rows", "source", "row-steps that verified a draft source's guesses"),
    ("specdec_plain_steps", "plain_steps", "reason", "steps decoded without guesses, by why (cost: the cost model "
                                                     "found no guess worth its price; guard: the batch guard; "
                                                     "nothing: no source had a guess; warming, probe)"),
)
GAUGES = (
    ("specdec_acceptance_rate", "alpha", "accepted / proposed guesses"),
    ("specdec_mean_accepted_length", "tau", "tokens committed per target forward of a row"),
    ("specdec_batch_size", "batch", "rows decoding now"),
    ("specdec_queue_size", "queued", "requests waiting to join the batch"),
    ("specdec_draft_length", "draft_k", "guess slots per row in the last step"),
)


class _BatcherCollector:
    def __init__(self, batcher) -> None:
        self.batcher = batcher

    def collect(self):
        s = self.batcher.stats()
        for name, key, doc in COUNTERS:
            c = CounterMetricFamily(name, doc)
            c.add_metric([], getattr(s, key))
            yield c
        for name, key, label, doc in LABELLED:
            c = CounterMetricFamily(name, doc, labels=[label])
            for value, count in sorted(getattr(s, key).items()):
                c.add_metric([value], count)
            yield c
        for name, key, doc in GAUGES:
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], getattr(s, key))
            yield g


class ServerMetrics:
    """The registry /metrics renders: the batcher's figures and three latency histograms."""

    def __init__(self, batcher) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_BatcherCollector(batcher))
        self.ttft = Histogram("specdec_time_to_first_token_seconds",
                              "per finished choice with a token: seconds from its submission to its first token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.per_token = Histogram("specdec_time_per_output_token_seconds",
                                   "per finished choice with a token: its seconds over its generated tokens",
                                   buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("specdec_request_seconds",
                             "per finished choice: seconds from the HTTP request's arrival to its last token",
                             buckets=LATENCY_BUCKETS, registry=self.registry)

    def observe_finished(self, seconds: float, stats: dict) -> None:
        """One choice that ended normally, `seconds` after its HTTP request arrived; stats: the
        batcher's (completion_tokens, first_token_s). Called from the batcher's thread
        (prometheus_client's histograms are thread-safe)."""
        self.e2e.observe(seconds)
        if stats["completion_tokens"] and stats.get("first_token_s") is not None:
            self.ttft.observe(stats["first_token_s"])
            self.per_token.observe(seconds / stats["completion_tokens"])

    def render(self) -> tuple[bytes, str]:
        """(body, content type) for a scrape."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
