"""The engine's own counters (the scheduler and the KV cache manager keep theirs)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_step_seconds: float = 0.0
    """Time of steps that computed any prefill token (mixed steps included)."""
    decode_step_seconds: float = 0.0
    """Time of steps that only decoded."""
