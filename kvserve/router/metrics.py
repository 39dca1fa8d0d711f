"""The router's /metrics (its own registry): per replica, what was sent and what was predicted.

The prediction is checked against what each answer reports
(`usage.prompt_tokens_details.cached_tokens`): `prediction_exact_total`
counts answers whose cached tokens equal the predicted hit,
`prediction_wrong_total` the others, `prediction_unverified_total` those
that carried no usage (a stream without `stream_options.include_usage`, an
error) or had no prediction (a replica whose events are not followed).
Loads, health and the size of each replica's view are read at scrape time.
What routing itself costs a request before it is sent: `tokenize_seconds`
(the prompt through the chat template and tokenizer) and `predict_seconds`
(after tokenizing: what is left of bringing every followed view up to date,
a round trip started as the request arrived, then the match).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvserve.router.replicas import Replica

PREFIX = "kvserve:router_"
STAGE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
"""Seconds: routing should cost a millisecond or two; the tail is what to see."""
FALLBACK_REASONS = ("timeout", "failed", "status")
"""Why a prefill did not help (disaggregated.py): no answer within --prefill-timeout, the
call failed (the engine down or its connection lost), an answer other than 200."""


class RouterMetrics:
    def __init__(
        self, replicas: list[Replica], view_stats: Callable[[int], tuple[bool, int, int]]
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = [r.url for r in replicas]

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"{PREFIX}{name}", doc, ["replica"], registry=self.registry)

        self.requests = counter("requests", "Requests sent to the replica (retries included).")
        self.retries = counter(
            "retries",
            "Requests that failed on the replica before any byte, or got a 503, and were resent.",
        )
        self.predicted = counter(
            "predicted_hit_tokens", "Prefix-cache hit tokens predicted for requests sent to it."
        )
        self.reported = counter(
            "reported_cached_tokens", "Cached tokens the replica's answers reported."
        )
        self.exact = counter(
            "prediction_exact", "Answers whose cached tokens equal the predicted hit."
        )
        self.wrong = counter("prediction_wrong", "Answers whose cached tokens differ from it.")
        self.unverified = counter(
            "prediction_unverified", "Answers without usage, or requests without a prediction."
        )
        self.prefill_fallbacks = Counter(
            f"{PREFIX}prefill_fallbacks",
            "Prefills that did not help (the prefill engine too slow, failing, or down): the "
            "decode engine computed the prompt.",
            ["replica", "reason"], registry=self.registry,
        )  # fmt: skip
        self.tokenize_seconds = Histogram(
            f"{PREFIX}tokenize_seconds", "Tokenizing a request's prompts to predict its hits.",
            buckets=STAGE_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.predict_seconds = Histogram(
            f"{PREFIX}predict_seconds", "After tokenizing: views up to date, then matched.",
            buckets=STAGE_BUCKETS, registry=self.registry,
        )  # fmt: skip
        for replica in replicas:
            if replica.role == "prefill":
                for reason in FALLBACK_REASONS:
                    self.prefill_fallbacks.labels(replica.url, reason)
        every = (self.requests, self.retries, self.predicted, self.reported)
        for label in self.labels:  # each series from 0, so rates work from the first scrape
            for series in (*every, self.exact, self.wrong, self.unverified):
                series.labels(label)
        self.registry.register(_Live(replicas, view_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Live(Collector):
    """Health, loads and the event-fed views, read when scraped."""

    def __init__(
        self, replicas: list[Replica], view_stats: Callable[[int], tuple[bool, int, int]]
    ) -> None:
        self.replicas = replicas
        self.view_stats = view_stats

    def collect(self) -> Iterator[Metric]:
        healthy = gauge("replica_healthy", "1 while the replica answers /health with 200.")
        running = gauge("requests_running", "Requests sent to the replica and not finished.")
        queued = gauge("queued_prefill_tokens", "Prompt tokens sent whose answer has not begun.")
        followed, blocks, resyncs = view_families()
        for r in self.replicas:
            is_followed, n_blocks, n_resyncs = self.view_stats(r.index)
            healthy.add_metric([r.url], float(r.healthy))
            followed.add_metric([r.url], float(is_followed))
            running.add_metric([r.url], r.running)
            queued.add_metric([r.url], r.queued_prefill_tokens)
            blocks.add_metric([r.url], n_blocks)
            resyncs.add_metric([r.url], n_resyncs)
        yield from (healthy, running, queued, followed, blocks, resyncs)


def gauge(name: str, doc: str) -> GaugeMetricFamily:
    """A per-replica gauge read at scrape time."""
    return GaugeMetricFamily(f"{PREFIX}{name}", doc, labels=["replica"])


def view_families() -> tuple[GaugeMetricFamily, GaugeMetricFamily, CounterMetricFamily]:
    """The router's event-fed view of each replica: followed, its blocks, its rebuilds."""
    return (
        gauge("events_followed", "1 while the router follows the replica's KV events."),
        gauge("view_blocks", "Blocks in the router's event-fed view of the replica."),
        CounterMetricFamily(
            f"{PREFIX}view_resyncs", "Views rebuilt from a snapshot.", labels=["replica"]
        ),
    )
