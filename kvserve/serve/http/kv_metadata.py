"""`GET /kv-metadata`: what a router needs to predict this replica's prefix hits.

The engine's part is the very dict its event publisher answers `kv-metadata`
with (kvserve.kvcache.event_metadata: hashing, groups, block sizes); the
server adds what only it knows: the checkpoint (a router loads the same
tokenizer and chat template from it), the served name, where the events
are published, and its `--pooling` rule (a `mean` embedding shares no prompt
blocks, so a router predicts it no hit). serve/build.py adds `limits`
(kvserve.request_limits.PromptLimits: max_model_len, the longest prompt string, max_n,
the batch and JSON depth bounds, --max-tools and whether the template writes the tools
into the prompt), so a router refuses unread what this replica would.
Built once at start: none of it changes while serving.
"""

from __future__ import annotations

from typing import Any

from kvserve.engine.llm_engine import LLMEngine
from kvserve.kvcache.event_metadata import kv_events_metadata


def kv_metadata_body(
    engine: LLMEngine, model_path: str, served_name: str, pooling: str
) -> dict[str, Any]:
    """`kv_events`: the PUB and replay endpoints (ports already offset by the data-parallel
    rank) and the topic, or None when the engine publishes no events."""
    events = engine.kv_events
    endpoints = None
    if events is not None:
        publisher = events.publisher
        endpoints = {
            "endpoint": publisher.endpoint,
            "replay_endpoint": publisher.replay_endpoint,
            "topic": events.config.topic,
            "data_parallel_rank": publisher.data_parallel_rank,
        }
    return {
        "model": model_path,
        "served_model_name": served_name,
        "enable_prefix_caching": engine.manager.enable_caching,
        "pooling": pooling,
        "kv_events": endpoints,
        "kv_metadata": events.metadata
        if events is not None
        else kv_events_metadata(engine.manager),
    }
