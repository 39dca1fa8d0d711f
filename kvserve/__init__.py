"""kvserve: a compact LLM inference engine whose KV cache is exactly right."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvserve.version import __version__ as __version__

__all__ = [
    "LLM",
    "CompletionOutput",
    "KVEventsConfig",
    "LoRARequest",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
]

if TYPE_CHECKING:
    from kvserve.events.config import KVEventsConfig
    from kvserve.llm import LLM
    from kvserve.lora.request import LoRARequest
    from kvserve.outputs import CompletionOutput, RequestOutput
    from kvserve.pooling_params import PoolingParams
    from kvserve.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    # Lazy: `import kvserve.kvcache` must stay free of torch and of the engine.
    if name == "LLM":
        from kvserve.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvserve.sampling_params import SamplingParams

        return SamplingParams
    if name == "PoolingParams":
        from kvserve.pooling_params import PoolingParams

        return PoolingParams
    if name == "LoRARequest":
        from kvserve.lora.request import LoRARequest

        return LoRARequest
    if name == "KVEventsConfig":
        from kvserve.events.config import KVEventsConfig

        return KVEventsConfig
    if name in ("RequestOutput", "CompletionOutput"):
        from kvserve import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
