"""What the scheduler is told (its limits and policy) and what it counts: plain data."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.engine.engine_args import SCHEDULING_POLICIES


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    scheduling_policy: str = "fcfs"
    """vLLM's: fcfs (every request's priority is 0) or priority (lower is earlier)."""
    max_loras: int | None = None
    """Distinct LoRA adapters among the running requests (None: no adapters)."""

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                f"got {self.scheduling_policy!r}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass(slots=True)
class SchedulerStats:
    prompt_tokens: int = 0
    prefill_tokens_computed: int = 0
    decode_tokens_computed: int = 0
    prefix_hit_tokens: int = 0
    external_hit_tokens: int = 0
    """Prompt tokens loaded from the external tiers instead of computed."""
    external_query_tokens: int = 0
    """Prompt tokens looked up in the external tiers (those past the local hit)."""
    preemptions: int = 0
    rejected: int = 0
    steps: int = 0
    manager_seconds: float = 0.0
    """Wall time inside KV cache manager calls (hashing, lookup, allocate, free)."""
