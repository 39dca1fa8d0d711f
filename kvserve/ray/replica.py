"""`KVServeReplica`: one Ray Serve replica, one engine, answered by `kvserve serve`'s handlers.

The replica builds its engine exactly as `kvserve serve` does (kvserve.serve.build, from the
same options) and answers each forwarded request with the same app (asgi.py). Two things are
Ray's own: where its KV events are published, and how the router learns it.

- Events: on by default, bound to this node's address on ports ZMQ picks
  (`tcp://NODE_IP:*`), so replicas on one node never collide; a `kv_events_config` given
  keeps its own settings, with the endpoints filled in where it names none.
- Advertised through Ray: `record_routing_stats` (Serve asks every replica periodically and
  hands the answers to the request routers) carries this replica's /kv-metadata (the event
  endpoints, the checkpoint, the hashing), a boot id (a replica restarted in place is
  followed from scratch) and its KV numbers for the ingress's /metrics.
- Health: `check_health` raises once the engine thread died, so Serve replaces the replica.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import uuid
from collections.abc import AsyncIterator
from typing import Any

import ray
from starlette.types import Message

from kvserve.cli.engine_options import engine_args_from
from kvserve.cli.serve import API_KEY_ENV, limits_from
from kvserve.ray.asgi import run_asgi
from kvserve.ray.options import parse_serve_argv
from kvserve.serve.build import build_served_engine, lora_options
from kvserve.serve.http.engine_thread import freeze_heap

log = logging.getLogger("kvserve.ray")


def node_events(config: str | None, host: str) -> str:
    """KV events on, bound to `host` on free ports unless the config says where."""
    value: dict[str, Any] = {}
    if config is not None:
        value = json.loads(config)
        if not isinstance(value, dict):
            raise ValueError("kv_events_config must be a JSON object")
    address = f"[{host}]" if ":" in host else host
    value.setdefault("enable_kv_cache_events", True)
    if "endpoint" not in value:
        value.update(endpoint=f"tcp://{address}:*", bind=True)
    value.setdefault("replay_endpoint", f"tcp://{address}:*")
    return json.dumps(value)


class KVServeReplica:
    """The engine deployment's class (deployed by app.py with the builder's options)."""

    def __init__(self, serve_argv: list[str]) -> None:
        args = parse_serve_argv(serve_argv)
        engine_args = engine_args_from(args)
        lora_options(args, engine_args)  # --lora-modules, as `kvserve serve` reads them
        self.host = ray.util.get_node_ip_address()
        engine_args.kv_events_config = node_events(engine_args.kv_events_config, self.host)
        api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
        self.served = build_served_engine(
            args, engine_args, limits_from(args), api_key, on_death=self._died
        )
        self.app = self.served.app()
        self.boot = uuid.uuid4().hex
        freeze_heap()  # a replica's process serves this one engine for its life
        self.served.engine.start()
        log.info("replica %s: serving %s", self.boot, self.served.llm.model.description)

    def _died(self, reason: str) -> None:
        log.error("the engine died (%s): Serve replaces this replica", reason)

    async def handle(self, scope: dict[str, Any], body: bytes) -> AsyncIterator[Message]:
        """One forwarded HTTP request's ASGI messages (called with stream=True)."""
        async for message in run_asgi(self.app, scope, body):
            yield message

    def record_routing_stats(self) -> dict[str, Any]:
        """What the request routers know this replica by (see the module docstring)."""
        state = self.served.state
        snap = state.metrics.snapshot if state.metrics is not None else None
        kv = dataclasses.asdict(snap) if snap is not None else {}
        kv.pop("finished", None)
        kv.pop("dropped_writes", None)
        adapters = state.adapters.metadata() if state.adapters is not None else []
        return {
            "kvserve": {
                **(state.kv_metadata or {}),
                "lora_adapters": adapters,  # their identities: the router hashes with them
                "boot": self.boot,
                "host": self.host,
                "kv": kv,
            }
        }

    def check_health(self) -> None:
        dead = self.served.engine.dead
        if dead is not None:
            raise RuntimeError(f"the engine died: {dead}")

    def __del__(self) -> None:
        """Serve's shutdown of the replica: the engine stops, its last events go out."""
        if hasattr(self, "served") and not getattr(self, "closed", False):
            self.closed = True
            self.served.close()
