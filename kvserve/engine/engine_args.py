"""The engine's options, in one place: `LLM(model, **kwargs)` and `LLMEngine` share them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True, kw_only=True)
class EngineArgs:
    """Every keyword `LLM` accepts; an unknown one is a TypeError (a typo must not
    silently fall back to a default)."""

    block_size: int = 16
    num_kv_blocks: int | None = None
    """KV blocks; default: sized from available memory (capped) and logged."""
    kv_cache_memory: int | None = None
    """Bytes for the KV cache, instead of `num_kv_blocks`."""
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    """Default: the model's max_position_embeddings."""
    enable_prefix_caching: bool = True
    dtype: str = "auto"
    """auto: float32 on the CPU, bfloat16 on CUDA."""
    seed: int = 0
    device: str | None = None
    hash_fn: str = "sha256"
    hash_seed: int = 0
    num_threads: int | None = None
    """CPU threads; default $OMP_NUM_THREADS, else all cores."""
    kv_events_config: Any = None
    """KVEventsConfig or its dict (vLLM's keys); None: no events."""
    offload: str | None = None
    """External KV tiers, e.g. "cpu:8GiB,disk:/path/to/dir:50GiB" (either alone); None: off."""
