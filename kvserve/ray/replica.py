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
- Run-time LoRA adapters (kvserve.ray.adapters): a load or unload the ingress broadcasts
  (`adapter_change`), and the application's adapter book read before the first request
  and whenever it changes, so a replica Serve starts later serves them too.
- Health: `check_health` raises once the engine thread died, so Serve replaces the replica.
- Prefill and decode (the builder's `prefill`/`decode` sections): a prefill replica is a KV
  transfer producer serving its CPU tier's blocks on this node's address, on a port ZMQ
  picks (`prefill` answers the ingress with that endpoint, so a replica restarted on
  another port is found by its next answer); a decode replica is a consumer that is told,
  with each request, the producer that ran its prompt (kvserve.transfer.producers).
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
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.types import Message

from kvserve.cli.engine_options import engine_args_from
from kvserve.cli.serve import API_KEY_ENV, limits_from
from kvserve.ray.adapters import GENERATION, ReplicaAdapters
from kvserve.ray.asgi import run_asgi
from kvserve.ray.options import parse_serve_argv
from kvserve.router.forward import CachedTokens
from kvserve.serve.build import build_served_engine, lora_options
from kvserve.serve.http.engine_thread import freeze_heap

ROLES = ("both", "prefill", "decode")

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


def transfer_role(role: str, host: str, hold_seconds: float = 30.0) -> str:
    """A prefill replica's producer on `host`, on the port ZMQ picks (told in each prefill's
    answer), keeping blocks `hold_seconds` unless pulled; a decode replica's consumer, told
    of its producers with each request."""
    if role == "prefill":
        extra = {"hold_seconds": hold_seconds}
        return json.dumps({"kv_role": "kv_producer", "kv_ip": host, "kv_port": 0,
                           "kv_connector_extra_config": extra})  # fmt: skip
    return json.dumps({"kv_role": "kv_consumer", "kv_connector_extra_config": {"discover": True}})


class KVServeReplica:
    """The engine deployment's class (deployed by app.py with the builder's options)."""

    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor
        self,
        serve_argv: list[str],
        role: str = "both",
        book: DeploymentHandle | None = None,
        hold_seconds: float = 30.0,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"role {role!r}: one of {', '.join(ROLES)}")
        args = parse_serve_argv(serve_argv)
        engine_args = engine_args_from(args)
        lora_options(args, engine_args)  # --lora-modules, as `kvserve serve` reads them
        self.host = ray.util.get_node_ip_address()
        engine_args.kv_events_config = node_events(engine_args.kv_events_config, self.host)
        if role != "both":
            engine_args.kv_transfer_config = transfer_role(role, self.host, hold_seconds)
        api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
        self.served = build_served_engine(
            args, engine_args, limits_from(args), api_key, on_death=self._died
        )
        self.app = self.served.app()
        self.boot = uuid.uuid4().hex
        freeze_heap()  # a replica's process serves this one engine for its life
        tiers = self.served.llm.engine.tiers
        server = tiers.server if tiers is not None else None
        self.producer: str | None = server.endpoint if server is not None else None
        """A prefill replica's block server (tcp://node:port)."""
        self.producers = tiers.producers if tiers is not None else None
        """A decode replica's producers (told of with each request)."""
        self.served.engine.start()
        self.adapters = ReplicaAdapters(
            self.app,
            serve.get_replica_context().replica_id.unique_id,
            lambda: self._listed(),
            book if self.served.state.adapters is not None else None,
            api_key,
        )
        await self.adapters.start()  # the run-time adapters, before the first request
        log.info("replica %s: serving %s", self.boot, self.served.llm.model.description)

    def _died(self, reason: str) -> None:
        log.error("the engine died (%s): Serve replaces this replica", reason)

    async def handle(
        self, scope: dict[str, Any], body: bytes, producer: str | None = None
    ) -> AsyncIterator[Message]:
        """One forwarded HTTP request's ASGI messages (called with stream=True); `producer`:
        the prefill replica that ran its prompt (a decode replica pulls its blocks there)."""
        if producer is not None and self.producers is not None:
            self.producers.tell(producer)
        async for message in run_asgi(self.app, scope, body):
            yield message

    async def adapter_change(
        self, scope: dict[str, Any], body: bytes, only: list[str] | None = None
    ) -> dict[str, Any] | None:
        """A run-time load or unload, sent by the ingress to every replica (adapters.py)."""
        return await self.adapters.change(scope, body, only)

    def _listed(self) -> list[dict[str, str]]:
        adapters = self.served.state.adapters
        return adapters.metadata() if adapters is not None else []

    async def prefill(self, scope: dict[str, Any], body: bytes) -> dict[str, Any]:
        """Run a request's one-token copy (the ingress's prefill/decode split): its status,
        the cached tokens it reported, and where this replica serves the prompt's blocks."""
        status, cached = 0, CachedTokens()
        async for message in run_asgi(self.app, scope, body):
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body":
                cached.feed(message.get("body", b""))
        return {"status": status, "cached_tokens": cached.cached, "producer": self.producer}

    async def record_routing_stats(self) -> dict[str, Any]:
        """What the request routers know this replica by (see the module docstring); and a
        look at the adapter book (on the replica's loop, where the adapters change)."""
        self.adapters.look_soon()
        state = self.served.state
        snap = state.metrics.snapshot if state.metrics is not None else None
        kv = dataclasses.asdict(snap) if snap is not None else {}
        kv.pop("finished", None)
        kv.pop("dropped_writes", None)
        tiers = self.served.llm.engine.tiers
        transfer = tiers.transfer_stats() if tiers is not None else None
        for name in ("blocks_received", "blocks_served"):
            if transfer is not None and name in transfer:
                kv[f"transfer_{name}"] = transfer[name]
        adapters = self._listed()
        return {
            "kvserve": {
                **(state.kv_metadata or {}),
                "lora_adapters": adapters,  # their identities: the router hashes with them
                GENERATION: self.adapters.generation,  # how many run-time changes made them
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
