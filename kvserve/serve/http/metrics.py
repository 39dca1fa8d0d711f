"""Prometheus metrics named as vLLM names them, so gateways and dashboards work unchanged.

Two sources, one owner each. Gauges and counters of engine state are read at
scrape time from the engine thread's latest `EngineSnapshot` (a plain object
it replaces after every step and command, so the HTTP thread never touches the
engine). Latencies are observed by the engine thread as outputs leave it
(`EngineObserver`), into histograms, which prometheus_client makes thread-safe.
Every series has the `model_name` label; the prefix is `kvserve` unless
`--metrics-prefix vllm` asks for vLLM's own names.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvserve.outputs import RequestOutput
from kvserve.serve.http.engine_families import (
    LoRAInfo,
    dropped_writes,
    lora_info,
    spec_decode,
    spec_decode_families,
    transfer_counts,
    transfer_families,
)

if TYPE_CHECKING:
    from kvserve.engine.llm_engine import LLMEngine

PREFIXES = ("kvserve", "vllm")
REASONS = ("stop", "length", "abort")
"""Finish reasons, each exported from the start (at 0) so rates work from the first scrape."""

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.5, 3.0, 6.0, 12.0, 30.0, 60.0)
_LONG_BUCKETS = (0.1, 0.3, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 900.0)
_TOKEN_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(slots=True, frozen=True)
class EngineSnapshot:
    """The engine's counts after a step: what the gauges and counters export."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    """Blocks held by requests over usable blocks; cached free blocks are not used."""
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    external_query_tokens: int = 0
    external_hit_tokens: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: tuple[tuple[str, int], ...] = ()
    """(finish reason, completions finished with it) since start."""
    dropped_writes: tuple[tuple[str, int], ...] = ()
    """(tier medium, KV block writes to it that did not land) since start; () without tiers."""
    spec_decode: tuple[int, int, int, tuple[int, ...]] | None = None
    """Speculative decoding's (drafts, draft tokens, accepted tokens, accepted per
    position) since start; None when the engine does not speculate."""
    lora: LoRAInfo | None = None
    """The adapters running and waiting; None without enable_lora."""


@dataclass(slots=True, frozen=True)
class CacheConfigInfo:
    """The labels of `cache_config_info` (a gauge of 1, vLLM's way to export settings)."""

    block_size: int
    hash_block_size: int
    num_gpu_blocks: int
    hash_algo: str
    enable_prefix_caching: bool


class ServerMetrics:
    """The registry `/metrics` renders, and the histograms the engine thread fills."""

    def __init__(self, prefix: str, model_name: str, cache: CacheConfigInfo) -> None:
        if prefix not in PREFIXES:
            raise ValueError(f"metrics prefix must be one of {PREFIXES}, got {prefix!r}")
        self.registry = CollectorRegistry(auto_describe=True)
        self.snapshot = EngineSnapshot()
        """Replaced (never mutated) by the engine thread."""
        self.transfer_counts: Callable[[], tuple[tuple[str, float], ...] | None] | None = None
        """KV transfer's counters, read at scrape: a producer serves blocks between its
        steps, so a snapshot would lag (set with the first refresh; None: no transfer)."""
        self._state = _StateCollector(self, prefix, model_name, cache)
        self.registry.register(self._state)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            metric = Histogram(
                f"{prefix}:{name}",
                doc,
                ["model_name"],
                buckets=buckets,
                registry=self.registry,
            )
            return metric.labels(model_name=model_name)

        self.ttft = histogram(
            "time_to_first_token_seconds",
            "Seconds from a request's arrival to its first generated token.",
            _LATENCY_BUCKETS,
        )
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Seconds between two outputs of a request that carried new tokens.",
            _LATENCY_BUCKETS,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds",
            "Seconds from a request's arrival to its last token.",
            _LONG_BUCKETS,
        )
        self.queue = histogram(
            "request_queue_time_seconds",
            "Seconds a request waited before its first step.",
            _LONG_BUCKETS,
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total",
            "Tokens (prefill and decode) computed per engine step.",
            _TOKEN_BUCKETS,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector(Collector):
    """Gauges and counters built from the latest snapshot at each scrape."""

    def __init__(
        self, metrics: ServerMetrics, prefix: str, model_name: str, cache: CacheConfigInfo
    ) -> None:
        self.metrics = metrics
        self.prefix = prefix
        self.model_name = model_name
        self.cache = cache

    def describe(self) -> list[Metric]:
        return list(self._families(EngineSnapshot()))

    def collect(self) -> Iterator[Metric]:
        return self._families(self.metrics.snapshot)

    def _families(self, snap: EngineSnapshot) -> Iterator[Metric]:
        p, labels, model = self.prefix, ["model_name"], [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"{p}:{name}", doc, labels=labels)
            family.add_metric(model, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(f"{p}:{name}", doc, labels=labels)
            family.add_metric(model, value)
            return family

        yield gauge("num_requests_running", "Sequences in the running batch.", snap.running)
        yield gauge("num_requests_waiting", "Sequences waiting to be scheduled.", snap.waiting)
        yield gauge(
            "kv_cache_usage_perc",
            "Fraction of KV blocks held by requests (1 = full; cached free blocks count as free).",
            snap.kv_usage,
        )
        yield counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            snap.prefix_query_tokens,
        )
        yield counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache.", snap.prefix_hit_tokens
        )
        yield counter(
            "external_prefix_cache_queries",
            "Prompt tokens looked up in the external KV tiers.",
            snap.external_query_tokens,
        )
        yield counter(
            "external_prefix_cache_hits",
            "Prompt tokens loaded from the external KV tiers.",
            snap.external_hit_tokens,
        )
        yield counter(
            "num_preemptions", "Preemptions (a sequence lost its blocks).", snap.preemptions
        )
        yield counter("prompt_tokens", "Prompt tokens of admitted requests.", snap.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", snap.generation_tokens)
        success = CounterMetricFamily(
            f"{p}:request_success",
            "Completions finished, by finish reason.",
            labels=["model_name", "finished_reason"],
        )
        for reason, count in snap.finished:
            success.add_metric([self.model_name, reason], count)
        yield success
        if snap.dropped_writes:  # only when the engine has offload tiers
            dropped = CounterMetricFamily(
                f"{p}:offload_dropped_writes",
                "KV block writes to an offload tier that did not land (queue full, I/O error).",
                labels=["model_name", "medium"],
            )
            for medium, count in snap.dropped_writes:
                dropped.add_metric([self.model_name, medium], count)
            yield dropped
        if snap.spec_decode is not None:
            yield from spec_decode_families(p, self.model_name, snap.spec_decode)
        live = self.metrics.transfer_counts
        transfer = live() if live is not None else None
        if transfer is not None:
            yield from transfer_families(p, self.model_name, transfer)
        if snap.lora is not None:
            lora = GaugeMetricFamily(
                f"{p}:lora_requests_info",
                "Running stats on LoRA requests: the adapters running and waiting (labels).",
                labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            )
            lora.add_metric([str(snap.lora.max_lora), snap.lora.running, snap.lora.waiting],
                            snap.lora.when)  # fmt: skip
            yield lora
        cache = self.cache
        info = GaugeMetricFamily(
            f"{p}:cache_config_info",
            "The KV cache's configuration, as labels.",
            labels=[
                "block_size",
                "hash_block_size",
                "num_gpu_blocks",
                "prefix_caching_hash_algo",
                "enable_prefix_caching",
            ],
        )
        info.add_metric(
            [
                str(cache.block_size),
                str(cache.hash_block_size),
                str(cache.num_gpu_blocks),
                cache.hash_algo,
                str(cache.enable_prefix_caching),
            ],
            1,
        )
        yield info


@dataclass(slots=True)
class _Times:
    arrival: float
    scheduled: float | None = None
    last_token: float | None = None


@dataclass(slots=True)
class EngineObserver:
    """The engine thread's side: request timestamps into histograms, counts into snapshots."""

    metrics: ServerMetrics
    _times: dict[str, _Times] = field(default_factory=dict)
    _finished: Counter[str] = field(default_factory=lambda: Counter(dict.fromkeys(REASONS, 0)))

    def arrived(self, request_id: str, when: float) -> None:
        self._times[request_id] = _Times(when)

    def aborted(self, request_id: str, num_completions: int) -> None:
        if self._times.pop(request_id, None) is not None:
            self._finished["abort"] += num_completions

    def refused(self, request_id: str) -> None:
        self._times.pop(request_id, None)

    def after_step(self, engine: LLMEngine, started: float, outputs: list[RequestOutput]) -> None:
        """After a step that began at `started` (monotonic): every output it produced."""
        now = time.monotonic()
        m = self.metrics
        if engine.last_step_num_tokens:
            m.iteration_tokens.observe(engine.last_step_num_tokens)
        for output in outputs:
            times = self._times.get(output.request_id)
            if times is None:
                continue
            if times.scheduled is None:  # its first output: its first step ran
                times.scheduled = started
                m.queue.observe(max(0.0, started - times.arrival))
            if any(c.token_ids for c in output.outputs):
                if times.last_token is None:
                    m.ttft.observe(now - times.arrival)
                else:
                    m.itl.observe(now - times.last_token)
                times.last_token = now
            if output.finished:
                m.e2e.observe(now - times.arrival)
                del self._times[output.request_id]
                self._finished.update(c.finish_reason or "abort" for c in output.outputs)
        self.refresh(engine)

    def refresh(self, engine: LLMEngine) -> None:
        """Publish the engine's counts (the engine thread calls this; scrapes read it)."""
        scheduler, manager = engine.scheduler, engine.manager
        pool = manager.pool
        if self.metrics.transfer_counts is None and engine.tiers is not None:
            self.metrics.transfer_counts = partial(transfer_counts, engine)
        self.metrics.snapshot = EngineSnapshot(
            running=len(scheduler.running),
            waiting=len(scheduler.waiting),
            kv_usage=pool.num_used / pool.num_usable if pool.num_usable else 0.0,
            prefix_query_tokens=manager.stats.query_tokens,
            prefix_hit_tokens=manager.stats.hit_tokens,
            external_query_tokens=scheduler.stats.external_query_tokens,
            external_hit_tokens=scheduler.stats.external_hit_tokens,
            preemptions=scheduler.stats.preemptions,
            prompt_tokens=scheduler.stats.prompt_tokens,
            generation_tokens=engine.stats.generated_tokens,
            finished=tuple(sorted(self._finished.items())),
            dropped_writes=dropped_writes(engine),
            spec_decode=spec_decode(engine),
            lora=lora_info(engine),
        )


def cache_config_info(engine: LLMEngine) -> CacheConfigInfo:
    config = engine.manager.config
    return CacheConfigInfo(
        block_size=config.block_size,
        hash_block_size=engine.runner.hash_block_size,
        num_gpu_blocks=engine.manager.num_usable_blocks,
        hash_algo=str(config.hash_fn),
        enable_prefix_caching=config.enable_prefix_caching,
    )
