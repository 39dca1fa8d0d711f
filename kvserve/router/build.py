"""Putting a router together: ask the replicas, load their tokenizer, follow their events, serve.

`build_router` does everything that can fail on bad input before a socket
opens (a replica that does not answer, replicas that disagree, a checkpoint
the router cannot read: each a ValueError of one line), so `kvserve route`
either serves or says why not.
"""

from __future__ import annotations

import logging

import uvicorn

from kvserve.model.checkpoint.tokenizer import load_tokenizer
from kvserve.request_limits import PromptLimits
from kvserve.router.app import create_app
from kvserve.router.follower import EventFollower
from kvserve.router.health import follow
from kvserve.router.lifecycle import RouterServer
from kvserve.router.limits import MAX_REQUEST_BYTES, loosest
from kvserve.router.metrics import RouterMetrics
from kvserve.router.replicas import discover
from kvserve.router.state import RouterState
from kvserve.routing import make_policy

log = logging.getLogger("kvserve.router")


def build_router(
    urls: list[str],
    policy: str = "cache-aware",
    api_key: str | None = None,
    model: str | None = None,
    wait: float = 30.0,
    health_interval: float = 1.0,
    max_request_bytes: int | None = None,
    roles: dict[str, str] | None = None,
) -> RouterState:
    """`model`: where the router reads the replicas' tokenizer (default: the path they report);
    `roles`: URL -> "prefill" or "decode" (prefill on one engine, decode on another)."""
    chosen = make_policy(policy)
    replicas = discover([u.rstrip("/") for u in urls], api_key, wait)
    for replica, url in zip(replicas, urls, strict=True):
        replica.role = (roles or {}).get(url, "both")
    path = model or replicas[0].info["model"]
    try:
        tokenizer = load_tokenizer(path)
    except OSError as exc:
        raise ValueError(f"cannot load the replicas' tokenizer from {path}: {exc}") from None
    follower = EventFollower()
    state = RouterState(
        replicas,
        chosen,
        follower,
        RouterMetrics(replicas, follower.stats),
        tokenizer,
        api_key,
        health_interval,
        MAX_REQUEST_BYTES if max_request_bytes is None else max_request_bytes,
        limits=loosest([PromptLimits.from_dict(r.info.get("limits")) for r in replicas]),
    )
    follower.start()
    for replica in replicas:
        if replica.event_source() is None and replica.caching:
            log.warning(
                "replica %s publishes no KV events with a replay socket: no hit predictions for it "
                "(--kv-events-config with enable_kv_cache_events and replay_endpoint)",
                replica.url,
            )
        follow(state, replica)
    return state


def serve_router(
    state: RouterState,
    host: str,
    port: int,
    shutdown_timeout: float = 30.0,
    log_level: str = "info",
) -> bool:
    """Serve until SIGTERM / Ctrl-C (drained) and close; returns whether a signal stopped it."""
    config = uvicorn.Config(
        create_app(state), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5
    )
    server = RouterServer(config, state, shutdown_timeout)
    names = ", ".join(r.url for r in state.replicas)
    log.info("routing %r (%s) over %s", state.replicas[0].info["served_model_name"],
             state.policy.name, names)  # fmt: skip
    try:
        server.run()
    finally:
        state.follower.close()
        state.close_threads()
    return server.signalled
