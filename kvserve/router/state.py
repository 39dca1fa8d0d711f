"""What the router's handlers share: the replicas, the policy, the event follower, the client.

Owned by the event loop: the replicas' counters, `draining` and `in_flight`
change only on it, so they need no lock. The tokenizer runs on one worker
thread of its own (a tokenizer is not made for concurrent calls), the
prefix index on the follower's thread.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvserve.router.follower import EventFollower
from kvserve.router.limits import MAX_REQUEST_BYTES
from kvserve.router.metrics import RouterMetrics
from kvserve.router.replicas import Replica
from kvserve.routing import Policy


def _tokenizer_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(1, thread_name_prefix="kvserve-router-tokenizer")


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
    tokenizer_thread: ThreadPoolExecutor = field(default_factory=_tokenizer_thread)
    draining: bool = False
    in_flight: int = 0
    """Requests being answered (the drain waits for 0)."""

    def http(self) -> httpx.AsyncClient:
        if self.client is None:
            raise RuntimeError("the router's HTTP client is not open")
        return self.client
