"""The series exported only while a feature is on: offload drops, speculative decoding,
LoRA adapters, KV transfer. Read from the engine between steps (the engine thread),
exported at scrape (metrics.py); each stays off /metrics when its feature is off."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.engine.request import Request


@dataclass(slots=True, frozen=True)
class LoRAInfo:
    """vLLM's `lora_requests_info` labels: the adapters in the batch and in the queue
    (comma-joined names), read between steps; its value is when (a Unix time), as vLLM's."""

    max_lora: int
    running: str
    waiting: str
    when: float


def lora_info(engine: LLMEngine) -> LoRAInfo | None:
    """The adapters of the running and waiting requests, by name (each once, in order)."""
    if engine.loras is None:
        return None
    scheduler = engine.scheduler

    def names(requests: Iterable[Request]) -> str:
        return ",".join(dict.fromkeys(r.lora.name for r in requests if r.lora is not None))

    return LoRAInfo(
        max_lora=scheduler.config.max_loras or 0,
        running=names(scheduler.running),
        waiting=names(scheduler.waiting),
        when=time.time(),
    )


def spec_decode(engine: LLMEngine) -> tuple[int, int, int, tuple[int, ...]] | None:
    drafter = engine.drafter
    if drafter is None:
        return None
    stats = drafter.stats
    per_pos = tuple(stats.accepted_per_pos or (0,) * drafter.config.num_speculative_tokens)
    return stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, per_pos


def spec_decode_families(
    p: str, model_name: str, spec: tuple[int, int, int, tuple[int, ...]]
) -> Iterator[Metric]:
    """vLLM's spec_decode series: its v1 counters, and v0's acceptance-rate gauge."""
    drafts, draft_tokens, accepted, per_pos = spec
    for name, doc, value in (
        ("spec_decode_num_drafts", "Verification rows: steps in which a request drafted.", drafts),
        ("spec_decode_num_draft_tokens", "Draft tokens proposed.", draft_tokens),
        ("spec_decode_num_accepted_tokens", "Draft tokens the target model accepted.", accepted),
    ):
        family = CounterMetricFamily(f"{p}:{name}", doc, labels=["model_name"])
        family.add_metric([model_name], value)
        yield family
    by_pos = CounterMetricFamily(
        f"{p}:spec_decode_num_accepted_tokens_per_pos",
        "Accepted draft tokens by their position in the draft (0: first).",
        labels=["model_name", "position"],
    )
    for position, count in enumerate(per_pos):
        by_pos.add_metric([model_name, str(position)], count)
    yield by_pos
    rate = GaugeMetricFamily(
        f"{p}:spec_decode_draft_acceptance_rate",
        "Accepted over proposed draft tokens since start (0 before any draft).",
        labels=["model_name"],
    )
    rate.add_metric([model_name], accepted / draft_tokens if draft_tokens else 0.0)
    yield rate


def dropped_writes(engine: LLMEngine) -> tuple[tuple[str, int], ...]:
    """The offload tiers' dropped writes by medium (their counters are thread-safe ints)."""
    tiers = engine.tiers
    if tiers is None:
        return ()
    return tuple(sorted(tiers.connector.store.dropped_by_medium.items()))


TRANSFER_SERIES = {
    "blocks_received": "KV blocks a decode engine pulled from its producers.",
    "bytes_received": "Bytes of the KV blocks pulled from the producers.",
    "blocks_rejected": "Pulled KV blocks that failed their checksum (recomputed).",
    "asks": "Answered asks to the producers (a request's run of blocks: one, or one per "
    "1,024 blocks).",
    "failed_asks": "Asks to a producer that failed (gone, slow, another model): recomputed.",
    "seconds": "Time spent asking the producers.",
    "blocks_served": "KV blocks this prefill engine served to its consumers.",
    "bytes_served": "Bytes of the KV blocks served to the consumers.",
    "kept_blocks": "KV blocks this prefill engine keeps for a pull that has not come yet.",
    "kept_released_by_pull": "Kept KV blocks released by a consumer's pull.",
    "kept_released_by_deadline": "Kept KV blocks released unpulled at their deadline "
    "(hold_seconds).",
    "kept_released_by_pressure": "Kept KV blocks evicted unpulled because the CPU tier was "
    "full of kept blocks (the consumer recomputes them).",
}
TRANSFER_GAUGES = {"kept_blocks"}


def transfer_counts(engine: LLMEngine) -> tuple[tuple[str, float], ...] | None:
    tiers = engine.tiers
    if tiers is None:
        return None
    counts = tiers.transfer_stats()
    return None if counts is None else tuple(sorted(counts.items()))


def transfer_families(
    p: str, model_name: str, counts: tuple[tuple[str, float], ...]
) -> Iterator[Metric]:
    for name, value in counts:
        kind = GaugeMetricFamily if name in TRANSFER_GAUGES else CounterMetricFamily
        family = kind(
            f"{p}:kv_transfer_{name}", TRANSFER_SERIES.get(name, name), labels=["model_name"]
        )
        family.add_metric([model_name], value)
        yield family
