"""Run-time LoRA adapters on Ray Serve: a load or unload through the ingress reaches every
engine replica, and a replica Serve starts later (a crash replaced, a scale-up) gets them too.

- The change: `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` arriving at the
  ingress are sent to every running replica of each engine deployment with
  `DeploymentHandle.broadcast` (Ray Serve's public fan-out to all of a deployment's
  replicas: no replica handles taken from the controller or the request router), and each
  replica answers it with `kvserve serve`'s own handler (the API key, the body's checks,
  the adapter's files read on its node). A load that fails on one replica is undone on
  those where it succeeded and answered with that replica's error, as `kvserve route` does
  (kvserve.router.adapters); an unload succeeds once no replica serves the name.
- The owner of the desired set: `AdapterBook`, a one-replica deployment of the application
  (no CPU) that every ingress replica writes after a change succeeded and every engine
  replica reads: at its start, before Serve sends it a request, and whenever the book's
  version moves (looked at with its routing stats, every `routing_stats_period_s`), so a
  replica started during a change, or one that missed it, converges on the book. A Serve
  deployment rather than a named actor: it lives and goes with the application. A book
  Serve restarted (empty, a new epoch) is taught the adapters by the first replica that
  sees it, so nothing is unloaded because the book forgot.
- The request routers learn the new identities from the broadcast's answers at once
  (book.py's `adapter_listeners`), not a routing-stats period later; a replica counts its
  changes (`lora_generation`), so stats recorded before a change do not undo what the
  router was told.

The book holds names and paths only: at most MAX_SERVED_ADAPTERS entries (a replica refuses
more), each under 8 KiB (the handler's limits on both strings).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi.responses import Response
from ray.serve.handle import DeploymentHandle
from starlette.types import ASGIApp

from kvserve.ray.asgi import run_asgi
from kvserve.ray.book import BOOK
from kvserve.request_limits import LimitError, decode_body
from kvserve.router.errors import error

log = logging.getLogger("kvserve.ray")
LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
ADAPTER_PATHS = (LOAD_PATH, UNLOAD_PATH)
ADAPTER_TIMEOUT_SECONDS = 300.0
"""A replica reads and checks the adapter's files before it answers a load."""
BOOK_TIMEOUT_SECONDS = 30.0
"""A starting replica waits this long for the book (Serve restarting it), then starts
without the run-time adapters and takes them when it next looks."""

T = TypeVar("T")
GENERATION = "lora_generation"
"""In a replica's routing stats and its answers to a change: how many changes it has made."""
Entries = dict[str, str]
"""Adapter name -> its path (as the load request named it)."""


class AdapterBook:
    """The application's run-time adapters (a Serve deployment of one replica)."""

    def __init__(self) -> None:
        self.epoch = uuid.uuid4().hex
        self.version = 0
        self.entries: Entries = {}

    def read(self) -> tuple[str, int, Entries]:
        return self.epoch, self.version, dict(self.entries)

    def put(self, name: str, path: str) -> None:
        self.entries[name] = path
        self.version += 1

    def drop(self, name: str) -> None:
        if self.entries.pop(name, None) is not None:
            self.version += 1

    def adopt(self, entries: Entries) -> tuple[str, int, Entries]:
        """A replica's adapters, taken by a book that never changed (Serve restarted it)."""
        if self.version == 0 and entries:
            self.entries, self.version = dict(entries), 1
        return self.read()


@dataclass(slots=True)
class Answer:
    """One replica's answer to a forwarded request, as plain data for the Ray call."""

    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"


async def answer(app: ASGIApp, scope: dict[str, Any], body: bytes) -> Answer:
    out = Answer(0, b"")
    async for message in run_asgi(app, scope, body):
        if message["type"] == "http.response.start":
            out.status = int(message["status"])
            for key, value in message.get("headers", ()):
                if key.lower() == b"content-type":
                    out.content_type = value.decode("latin-1")
        elif message["type"] == "http.response.body":
            out.body += message.get("body", b"")
    return out


def _name_path(body: bytes) -> tuple[str | None, str | None]:
    """The change's names, or None: a body the replicas refuse themselves (depth-bounded:
    a body nested 100,000 deep is their 400, not a crash here)."""
    try:
        parsed = decode_body(body)
    except LimitError:
        return None, None
    name, path = parsed.get("lora_name"), parsed.get("lora_path")
    return (name if isinstance(name, str) else None), (path if isinstance(path, str) else None)


@dataclass(slots=True)
class ReplicaAdapters:
    """One engine replica's run-time adapters: those told by the ingress or read in the book
    (its `lora_modules` are its own, never touched here)."""

    app: ASGIApp
    replica: str
    """Serve's unique id of this replica (the broadcast's answers are told apart by it)."""
    listed: Callable[[], list[dict[str, str]]]
    """The replica's adapters with their identities (its /kv-metadata `lora_adapters`)."""
    book: DeploymentHandle | None
    api_key: str | None
    applied: Entries = field(default_factory=dict)
    seen: tuple[str, int] = ("", -1)
    """The book's (epoch, version) this replica last reconciled with: an entry it could not
    load is tried again when the book next changes."""
    generation: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    looking: asyncio.Task[None] | None = None

    async def change(
        self, scope: dict[str, Any], body: bytes, only: list[str] | None = None
    ) -> dict[str, Any] | None:
        """A load or unload from the ingress (None: `only` names other replicas)."""
        if only is not None and self.replica not in only:
            return None
        async with self.lock:
            out = await answer(self.app, scope, body)
            name, path = _name_path(body)
            if out.status == 200 and name is not None:
                self.generation += 1
                if scope.get("path") == LOAD_PATH and path is not None:
                    self.applied[name] = path
                else:
                    self.applied.pop(name, None)
        return {
            "replica": self.replica,
            "status": out.status,
            "body": out.body,
            "content_type": out.content_type,
            "lora_adapters": self.listed(),
            GENERATION: self.generation,
        }

    async def start(self) -> None:
        """The book's adapters, loaded before the replica takes its first request."""
        if self.book is None:
            return
        try:
            async with asyncio.timeout(BOOK_TIMEOUT_SECONDS):
                await self._look()
        except TimeoutError:
            log.warning("the adapter book did not answer: the replica starts without it")

    def look_soon(self) -> None:
        """Compare with the book in the background (called with the routing stats)."""
        if self.book is not None and (self.looking is None or self.looking.done()):
            self.looking = asyncio.get_running_loop().create_task(self._look())

    async def _look(self) -> None:
        assert self.book is not None
        try:
            epoch, version, entries = await self.book.read.remote()
            if epoch != self.seen[0] and version == 0 and self.applied:
                epoch, version, entries = await self.book.adopt.remote(dict(self.applied))
            if (epoch, version) != self.seen:
                await self._reconcile(entries)
                self.seen = (epoch, version)
        except Exception as exc:  # the book restarting: the next look tries again
            log.warning("the adapter book could not be read: %s", exc)

    async def _reconcile(self, entries: Entries) -> None:
        async with self.lock:
            for name, path in list(self.applied.items()):
                if entries.get(name) != path and await self._send(UNLOAD_PATH, name):
                    del self.applied[name]
            for name, path in entries.items():
                if name not in self.applied and await self._send(LOAD_PATH, name, path):
                    self.applied[name] = path

    async def _send(self, path: str, name: str, lora_path: str | None = None) -> bool:
        fields = {"lora_name": name} | ({"lora_path": lora_path} if lora_path else {})
        out = await answer(self.app, self._scope(path), json.dumps(fields).encode())
        if out.status == 200:
            self.generation += 1
        else:
            log.warning("adapter %r from the book: %s answered %d: %s", name, path, out.status,
                        out.body[:500].decode(errors="replace"))  # fmt: skip
        return out.status == 200

    def _scope(self, path: str) -> dict[str, Any]:
        headers = [(b"content-type", b"application/json")]
        if self.api_key is not None:
            headers.append((b"authorization", f"Bearer {self.api_key}".encode()))
        return {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http",
            "method": "POST", "path": path, "raw_path": path.encode(), "root_path": "",
            "query_string": b"", "headers": headers,
        }  # fmt: skip


class AdapterChanges:
    """The ingress's side: a change sent to every replica of the engine deployments."""

    def __init__(self, engines: list[DeploymentHandle], book: DeploymentHandle) -> None:
        self.engines = [e.options(stream=False) for e in engines]
        self.book = book
        self.lock = asyncio.Lock()
        """One change at a time from this ingress: an undo meets no other change."""

    async def change(self, scope: dict[str, Any], body: bytes) -> Response:
        """A change runs to its end (its undo, the book) even if its client leaves."""
        return await asyncio.shield(asyncio.ensure_future(self._change(scope, body)))

    async def _change(self, scope: dict[str, Any], body: bytes) -> Response:
        load = scope.get("path") == LOAD_PATH
        name, path = _name_path(body)
        async with self.lock:
            answers = await self._broadcast(scope, body)
            if not answers:
                return error("no replica could take the change: none is running", 503)
            done = [a for a in answers if isinstance(a, dict) and a["status"] == 200]
            failed = next((a for a in answers if not isinstance(a, dict) or a["status"] != 200),
                          None)  # fmt: skip
            if load and failed is not None and done and name is not None:
                undo = json.dumps({"lora_name": name}).encode()
                headers = [(k, v) for k, v in scope.get("headers", ())
                           if k.lower() != b"content-length"]  # fmt: skip
                unload_scope = {**scope, "path": UNLOAD_PATH, "raw_path": UNLOAD_PATH.encode(),
                                "headers": headers}  # fmt: skip
                listed = await self._broadcast(unload_scope, undo, [a["replica"] for a in done])
                answers += listed
                done = []
            if name is not None and load and failed is None and path is not None:
                await self.book.put.remote(name, path)
            elif name is not None and not load and (done or _all_refused(answers)):
                await self.book.drop.remote(name)  # also one no replica could load
            self._tell_routers(answers)
        if failed is not None and not (not load and done):
            return _relayed(failed)
        return _relayed(done[0])

    async def _broadcast(
        self, scope: dict[str, Any], body: bytes, only: list[str] | None = None
    ) -> list[dict[str, Any] | str]:
        """Every running replica's answer (a string: why one gave none)."""
        out: list[dict[str, Any] | str] = []
        for engine in self.engines:
            try:
                sent = engine.broadcast("adapter_change", scope, body, only)
                results = await sent.results_async(
                    timeout_s=ADAPTER_TIMEOUT_SECONDS, return_exceptions=True
                )
            except Exception as exc:  # no replica running, or none answered in time
                out.append(f"{engine.deployment_name}: {type(exc).__name__}: {exc}")
                continue
            for result in results:
                if isinstance(result, BaseException):
                    out.append(f"{engine.deployment_name}: {type(result).__name__}: {result}")
                elif result is not None:
                    out.append(result)
        return out

    def _tell_routers(self, answers: list[dict[str, Any] | str]) -> None:
        adapters = {
            a["replica"]: {"lora_adapters": a["lora_adapters"], GENERATION: a[GENERATION]}
            for a in answers
            if isinstance(a, dict)
        }
        for engine in self.engines:
            listener = BOOK.adapter_listeners.get(engine.deployment_name)
            if listener is not None:
                with contextlib.suppress(Exception):
                    listener(adapters)


def _all_refused(answers: list[dict[str, Any] | str]) -> bool:
    """Every replica answered that it does not serve the name (400), none failed otherwise
    (a 401 without the key leaves the book as it is)."""
    return all(isinstance(a, dict) and a["status"] == 400 for a in answers)


def fresher(known: dict[str, Any], stats: dict[str, Any]) -> dict[str, Any]:
    """A replica's routing stats, but with the adapters its router was told after a change
    when the stats were recorded before that change (they would hash with the old ones)."""
    if known.get(GENERATION, 0) > stats.get(GENERATION, 0):
        return {**stats, "lora_adapters": known.get("lora_adapters"), GENERATION: known[GENERATION]}
    return stats


def serving(candidates: list[T], infos: list[dict[str, Any] | None], args: list[Any]) -> list[T]:
    """The candidates (their router's infos alongside) that serve the adapter a forwarded
    request's `model` names, as `kvserve route` sends an adapter request only to replicas
    that list it: needed only where they differ (one could not load an adapter of the book,
    its node lacking the path), so the body is read only then. All of them when none lists
    the name (the base model, or a name they all refuse)."""
    names = [{e.get("name") for e in (i or {}).get("lora_adapters") or ()} for i in infos]
    if all(n == names[0] for n in names) or len(args) != 2 or not isinstance(args[1], bytes):
        return candidates
    try:
        model = decode_body(args[1]).get("model")
    except LimitError:
        return candidates
    listed = [c for c, n in zip(candidates, names, strict=True) if model in n]
    return listed or candidates


def _relayed(answer: dict[str, Any] | str) -> Response:
    if isinstance(answer, str):
        return error(f"a replica could not take the change: {answer}", 503)
    return Response(answer["body"], answer["status"], media_type=answer["content_type"])
