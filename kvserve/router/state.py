"""What the router's handlers share: the replicas, the policy, the event follower, the client.

Owned by the event loop: the replicas' counters, `draining` and `in_flight`
change only on it, so they need no lock. The tokenizer runs on worker threads
of its own, each with its own copy (a tokenizer is not made for concurrent
calls): one for bodies up to SHORT_BODY_BYTES, one for larger ones, which takes
one at a time (a larger body arriving while it is busy is routed without a
prediction). So a long prompt, even one in the replicas' limits, never keeps
the short ones waiting. The prefix index is on the follower's thread.
"""

from __future__ import annotations

import asyncio
import copy
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvserve.request_limits import PromptLimits
from kvserve.router.follower import EventFollower
from kvserve.router.limits import MAX_REQUEST_BYTES
from kvserve.router.metrics import RouterMetrics
from kvserve.router.replicas import Replica
from kvserve.routing import Policy

SHORT_BODY_BYTES = 64 * 1024
"""Bodies up to this size are tokenized on the shared thread; larger ones on their own."""


def _tokenizer_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(1, thread_name_prefix="kvserve-router-tokenizer")


def _long_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(1, thread_name_prefix="kvserve-router-long-tokenizer")


@dataclass(slots=True)
class RouterState:
    replicas: list[Replica]
    policy: Policy
    follower: EventFollower
    metrics: RouterMetrics
    tokenizer: Any
    """The replicas' own tokenizer (kvserve.model.checkpoint.tokenizer.load_tokenizer), or None."""
    api_key: str | None = None
    """Wanted from clients and sent to the replicas (one key for the whole deployment)."""
    health_interval: float = 1.0
    max_request_bytes: int = MAX_REQUEST_BYTES
    """A larger request body is a 413, refused before it is read whole."""
    client: httpx.AsyncClient | None = None
    """Opened when the app starts (its connections belong to the event loop)."""
    limits: PromptLimits | None = None
    """The replicas' limits on prompts (the loosest of their /kv-metadata's `limits`)."""
    tokenizer_thread: ThreadPoolExecutor = field(default_factory=_tokenizer_thread)
    long_thread: ThreadPoolExecutor = field(default_factory=_long_thread)
    long_tokenizer: Any = None
    """The long bodies' copy of the tokenizer (made when the state is)."""
    long_work: Future[Any] | None = None
    """The long body being tokenized (a new one waits for nobody: none while it runs)."""
    prefill_min_tokens: int = 256
    """With prefill engines: a prompt with fewer new tokens is computed by the decode engine
    (disaggregated.py)."""
    prefill_timeout: float = 30.0
    """Seconds a prefill engine may take to answer before the decode engine computes the
    prompt instead (disaggregated.py)."""
    draining: bool = False
    in_flight: int = 0
    """Requests being answered (the drain waits for 0)."""
    adapter_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held while LoRA adapters are loaded or unloaded on the replicas (adapters.py)."""

    def __post_init__(self) -> None:
        if self.long_tokenizer is None and self.tokenizer is not None:
            self.long_tokenizer = copy.deepcopy(self.tokenizer)

    def long_lane_free(self) -> bool:
        return self.long_work is None or self.long_work.done()

    def close_threads(self) -> None:
        self.tokenizer_thread.shutdown(wait=False, cancel_futures=True)
        self.long_thread.shutdown(wait=False, cancel_futures=True)

    def http(self) -> httpx.AsyncClient:
        if self.client is None:
            raise RuntimeError("the router's HTTP client is not open")
        return self.client
