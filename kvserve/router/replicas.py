"""The replicas behind the router: what each says about itself, its load, its health.

The router asks every replica's GET /kv-metadata: the checkpoint (the router
tokenizes as the replicas do, so all must serve the same one under the same
name), the hashing and groups (the prefix index predicts hits with them) and
where the KV events are published. A wildcard endpoint (`tcp://*:5557`) is
reached at the replica's own host.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from kvserve.router.follower import EventSource
from kvserve.routing import ReplicaLoad

WILDCARDS = frozenset({"*", "0.0.0.0", "[::]", "::", "[*]"})


@dataclass(slots=True)
class Replica:
    """One replica; its counters are the event loop's (no lock)."""

    index: int
    url: str
    info: dict[str, Any]
    """Its GET /kv-metadata."""
    healthy: bool = True
    refusing: bool = False
    """It answered 503 (draining, or a full queue): nothing new until /health says 200."""
    running: int = 0
    """Requests sent to it whose answer has not ended."""
    queued_prefill_tokens: int = 0
    """Prompt tokens sent to it (less the predicted hit) whose answer has not begun."""
    role: str = "both"
    """"prefill", "decode" (`kvserve route --prefill / --decode`) or "both"."""

    @property
    def available(self) -> bool:
        """Whether a new request may go to it."""
        return self.healthy and not self.refusing

    def load(self, excluded: bool = False) -> ReplicaLoad:
        usable = self.available and not excluded
        return ReplicaLoad(self.running, self.queued_prefill_tokens, usable)

    @property
    def caching(self) -> bool:
        return bool(self.info.get("enable_prefix_caching", True))

    @property
    def shares_embedding_prompts(self) -> bool:
        """Whether its embeddings read and leave prompt blocks (`last` pooling; a `mean`
        one recomputes every token under a salt of its own)."""
        return self.caching and self.info.get("pooling", "last") == "last"

    def event_source(self) -> EventSource | None:
        """Where to follow its events; None without events or without a replay socket
        (a subscriber that joins late needs replay or a snapshot to start)."""
        return event_source(self.info, urlsplit(self.url).hostname or "127.0.0.1")


def event_source(info: dict[str, Any], host: str) -> EventSource | None:
    """A replica's event source from its /kv-metadata (`info`); a wildcard endpoint is
    reached at `host`. None: it publishes no events with replay, or does not cache."""
    events = info.get("kv_events")
    if not events or not events.get("replay_endpoint"):
        return None
    if not info.get("enable_prefix_caching", True):
        return None
    return EventSource(
        reachable(events["endpoint"], host),
        reachable(events["replay_endpoint"], host),
        events.get("topic") or "",
        info["kv_metadata"],
    )


def reachable(endpoint: str, host: str) -> str:
    """`tcp://*:5557` -> `tcp://HOST:5557`: a wildcard binds every interface, including HOST's."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    address, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if address in WILDCARDS:
        address = f"[{host}]" if ":" in host else host
    return f"tcp://{address}:{port}"


def headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def parse_info(url: str, resp: httpx.Response) -> dict[str, Any]:
    """A replica's /kv-metadata body, or a ValueError that says what is wrong."""
    if resp.status_code == 401:
        raise ValueError(f"{url} wants an API key (--api-key, or $KVSERVE_API_KEY)")
    if resp.status_code == 404:
        raise ValueError(f"{url} has no /kv-metadata: is it a kvserve serve replica?")
    if resp.status_code != 200:
        raise ValueError(f"{url}/kv-metadata answered {resp.status_code}")
    body = resp.json()
    if not isinstance(body, dict) or "kv_metadata" not in body or "model" not in body:
        raise ValueError(f"{url}/kv-metadata is not kvserve's")
    return body


def disagreement(reference: Replica, url: str, info: dict[str, Any]) -> str | None:
    """Why a replica cannot join the others (another checkpoint or name), or None."""
    for key in ("model", "served_model_name"):
        if info.get(key) != reference.info.get(key):
            return (
                f"replicas disagree on the {key.replace('_', ' ')}: {reference.url} has "
                f"{reference.info.get(key)!r}, {url} has {info.get(key)!r}"
            )
    return None


def discover(urls: list[str], api_key: str | None, wait: float) -> list[Replica]:
    """Every replica's /kv-metadata (each waited for up to `wait` seconds); they must agree."""
    replicas: list[Replica] = []
    with httpx.Client(headers=headers(api_key), timeout=5) as client:
        for index, url in enumerate(urls):
            deadline = time.monotonic() + wait
            while True:
                try:
                    info = parse_info(url, client.get(f"{url}/kv-metadata"))
                    break
                except httpx.HTTPError as exc:
                    if time.monotonic() > deadline:
                        raise ValueError(f"replica {url} does not answer ({exc})") from None
                    time.sleep(0.2)
            if replicas and (problem := disagreement(replicas[0], url, info)):
                raise ValueError(problem)
            replicas.append(Replica(index, url, info))
    return replicas
