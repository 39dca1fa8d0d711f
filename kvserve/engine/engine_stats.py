"""The engine's own counters (the scheduler and the KV cache manager keep theirs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class EngineStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_step_seconds: float = 0.0
    """Time of steps that computed any prefill token (mixed steps included)."""
    decode_step_seconds: float = 0.0
    """Time of steps that only decoded."""


def engine_counters(engine: Any) -> dict[str, Any]:
    """An LLMEngine's counters, under the names `simulate` reports too, plus cache counters
    (`engine` untyped: llm_engine.py imports this module)."""
    s = engine.scheduler.stats
    return {
        "prompt_tokens": s.prompt_tokens,
        "prefill_tokens_computed": s.prefill_tokens_computed,
        "decode_tokens_computed": s.decode_tokens_computed,
        "prefix_hit_tokens": s.prefix_hit_tokens,
        "peak_blocks_used": engine.manager.stats.peak_blocks_used,
        "duplicate_blocks_peak": engine.tracker.duplicates_peak,
        "preemptions": s.preemptions,
        "steps": s.steps,
        "generated_tokens": engine.stats.generated_tokens,
        "num_kv_blocks": engine.runner.num_blocks,
        "evictions": engine.manager.pool.num_evictions,
        "prefill_step_seconds": engine.stats.prefill_step_seconds,
        "decode_step_seconds": engine.stats.decode_step_seconds,
        "external_hit_tokens": s.external_hit_tokens,
        **(engine.tiers.stats() if engine.tiers is not None else {}),
        **(engine.drafter.stats_dict() if engine.drafter is not None else {}),
    }
