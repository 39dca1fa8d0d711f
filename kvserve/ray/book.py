"""The routing book of one ingress process: what the request router predicted for each request,
checked against what the answer reports, and the /metrics the ingress answers.

The request router (router.py) runs on Serve's router thread of the ingress process; the
ingress reads the answers on its own. They meet here, keyed by Serve's request id: the
router writes the replica it chose and the hit it predicted there; the ingress, when the
answer has passed, takes that entry and compares it with the answer's
`usage.prompt_tokens_details.cached_tokens` (exact, wrong, or unverified: no usage or no
prediction), as `kvserve route` counts them. Per replica (Serve's replica id) the series
have `kvserve route`'s names, plus the replica's own KV numbers from its routing stats.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from kvserve.router.metrics import FALLBACK_REASONS, PREFIX, gauge, view_families

ViewStats = dict[str, tuple[bool, int, int, dict[str, Any]]]
"""Replica -> (events followed, blocks in its view, views rebuilt, its KV numbers)."""
Predictor = Callable[[list[Any]], Awaitable[tuple[int, int] | None]]
"""A forwarded request's (scope, body) -> (its prompt tokens, the best hit predicted)."""


@dataclass(slots=True, frozen=True)
class Sent:
    replica: str
    predicted: int | None


class RoutingBook:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sent: dict[str, Sent] = {}
        self.registry = CollectorRegistry(auto_describe=True)
        self.views: dict[str, Callable[[], ViewStats]] = {}
        """Deployment -> its request router's views (one router per engine deployment)."""
        self.predictors: dict[str, Predictor] = {}
        """Deployment -> its request router's `best_hit` (the prefill/decode split's)."""
        self.adapter_listeners: dict[str, Callable[[dict[str, Any]], None]] = {}
        """Deployment -> its request router's `learn_adapters` (replica -> its adapters,
        told after a run-time load or unload: kvserve.ray.adapters)."""

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"{PREFIX}{name}", doc, ["replica"], registry=self.registry)

        self.requests = counter("requests", "Requests sent to the replica (retries included).")
        self.retries = counter(
            "retries", "Requests resent after the replica failed before answering."
        )
        self.predicted = counter("predicted_hit_tokens", "Prefix-cache hit tokens predicted.")
        self.reported = counter("reported_cached_tokens", "Cached tokens its answers reported.")
        self.exact = counter(
            "prediction_exact", "Answers whose cached tokens equal the prediction."
        )
        self.wrong = counter("prediction_wrong", "Answers whose cached tokens differ from it.")
        self.unverified = counter(
            "prediction_unverified", "Answers without usage, or requests without a prediction."
        )
        self.prefill_fallbacks = Counter(
            f"{PREFIX}prefill_fallbacks",
            "Prefills that did not help, by why: " + ", ".join(FALLBACK_REASONS) + " (the "
            "decode replica computed the prompt).",
            ["replica", "reason"],
            registry=self.registry,
        )
        self.registry.register(_Views(self))

    # -- the router's thread ---------------------------------------------------------

    def sent(self, request_id: str, replica: str, predicted: int | None) -> None:
        with self._lock:
            self._sent[request_id] = Sent(replica, predicted)
        self.requests.labels(replica).inc()
        if predicted is not None:
            self.predicted.labels(replica).inc(predicted)

    # -- the ingress -----------------------------------------------------------------

    def answered(
        self, request_id: str, status: int, cached: int | None, checkable: bool = True
    ) -> Sent | None:
        """Settle a request's prediction with what its answer said (None: not routed here).
        Not `checkable`: its cached tokens include blocks pulled from a prefill replica."""
        with self._lock:
            sent = self._sent.pop(request_id, None)
        if sent is None:
            return None
        label = sent.replica
        if cached is not None:
            self.reported.labels(label).inc(cached)
        if status != 200 or cached is None or sent.predicted is None or not checkable:
            self.unverified.labels(label).inc()
        elif cached == sent.predicted:
            self.exact.labels(label).inc()
        else:
            self.wrong.labels(label).inc()
        return sent

    def replica(self, request_id: str) -> str | None:
        """The replica a request was sent to (while it is answered)."""
        with self._lock:
            sent = self._sent.get(request_id)
        return sent.replica if sent is not None else None

    def forget(self, request_id: str) -> str | None:
        """A request whose replica failed before answering (it is sent again): its replica."""
        with self._lock:
            sent = self._sent.pop(request_id, None)
        if sent is not None:
            self.retries.labels(sent.replica).inc()
        return sent.replica if sent is not None else None

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Views(Collector):
    """The router's views and each replica's KV numbers, read when scraped."""

    KV = (
        ("running", "num_requests_running", "Requests in the replica's engine batch."),
        ("waiting", "num_requests_waiting", "Requests waiting in the replica's engine."),
        ("kv_usage", "kv_cache_usage_perc", "The replica's KV blocks in use (0-1)."),
        ("prefix_query_tokens", "prefix_cache_queries", "Prompt tokens looked up in its cache."),
        ("prefix_hit_tokens", "prefix_cache_hits", "Prompt tokens found in its prefix cache."),
        ("transfer_blocks_received", "kv_transfer_blocks_received",
         "KV blocks a decode replica pulled from the prefill replicas."),
        ("transfer_blocks_served", "kv_transfer_blocks_served",
         "KV blocks a prefill replica served to the decode replicas."),
    )  # fmt: skip

    def __init__(self, book: RoutingBook) -> None:
        self.book = book

    def collect(self) -> Iterator[Metric]:
        followed, blocks, resyncs = view_families()
        kv = {key: gauge(f"replica_{name}", doc) for key, name, doc in self.KV}
        views: ViewStats = {}
        for stats in list(self.book.views.values()):
            views.update(stats())
        for replica, (is_followed, n_blocks, n_resyncs, numbers) in views.items():
            followed.add_metric([replica], float(is_followed))
            blocks.add_metric([replica], n_blocks)
            resyncs.add_metric([replica], n_resyncs)
            for key, family in kv.items():
                if key in numbers:
                    family.add_metric([replica], float(numbers[key]))
        yield from (followed, blocks, resyncs, *kv.values())


BOOK = RoutingBook()
"""This process's book (one application's ingress per process: its engine deployment, or
its prefill and decode deployments)."""
