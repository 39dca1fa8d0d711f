"""`KVServeIngress`: the deployment behind Serve's HTTP proxy. It reads each request's body,
calls the engine deployment through its handle (whose request router, router.py, sees the
body and chooses the replica) and relays the answer as it comes, byte for byte.

A replica that fails before its first message (its actor died, or went away) costs the
client nothing: the request is sent again, and the router chooses among the replicas left,
as `kvserve route` retries before the first byte. After the first message a failure is
the client's to see: a stream ends with an error event, as a replica ends one when its
engine fails. A client that leaves cancels the call, and the replica aborts the request.

With prefill and decode deployments (the builder's `prefill`/`decode`), a request's
prompt first runs on a prefill replica (split.py), whose endpoint goes with the request to
the decode replica.

POST /v1/load_lora_adapter and /v1/unload_lora_adapter go to every engine replica
(adapters.py), the change then written in the application's adapter book.

GET /metrics answers this ingress's routing book (book.py): per replica, what was sent and
predicted and whether the predictions held, the router's views, each replica's KV numbers.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.types import Message

from kvserve.ray.adapters import ADAPTER_PATHS, AdapterChanges
from kvserve.ray.asgi import app_path, forwarded_scope
from kvserve.ray.book import BOOK
from kvserve.ray.split import PrefillFirst
from kvserve.router.errors import error
from kvserve.router.forward import HOP_BY_HOP, CachedTokens

log = logging.getLogger("kvserve.ray")
ATTEMPTS = 3
"""Sends of one request whose replica failed before its first message."""
FAILED = (RayActorError, ActorUnavailableError)
NOT_RELAYED = {h.encode() for h in HOP_BY_HOP}
REPLICA_HEADER = b"kvserve-replica"
"""The Serve replica id that answered (absent for answers the ingress gives itself)."""


class KVServeIngress:
    def __init__(
        self,
        engine: DeploymentHandle,
        max_request_bytes: int,
        prefill: DeploymentHandle | None = None,
        prefill_min_tokens: int = 0,
        prefill_timeout: float = 30.0,
        book: DeploymentHandle | None = None,
    ) -> None:
        self.engine = engine.options(stream=True)
        self.max_request_bytes = max_request_bytes
        self.split = (
            PrefillFirst(prefill, engine.deployment_name, prefill_min_tokens, prefill_timeout)
            if prefill is not None
            else None
        )
        engines = [engine] if prefill is None else [engine, prefill]
        self.adapters = AdapterChanges(engines, book) if book is not None else None

    async def __call__(self, request: Request) -> Response:
        if app_path(request.scope) == "/metrics" and request.method == "GET":
            return Response(BOOK.render(), media_type=CONTENT_TYPE_LATEST)
        body = bytearray()
        async for chunk in request.stream():  # no more than the replicas take: they say 413
            body += chunk
            if len(body) > self.max_request_bytes:
                break
        scope = forwarded_scope(request.scope)
        path = scope.get("path")
        if self.adapters is not None and path in ADAPTER_PATHS and request.method == "POST":
            return await self.adapters.change(scope, bytes(body))
        producer = None
        if self.split is not None and request.method == "POST":
            producer = await self.split.run(scope, bytes(body))
        failure = "no replica answered"
        for _ in range(ATTEMPTS):
            stream = self.engine.handle.remote(scope, bytes(body), producer=producer)
            assert isinstance(stream, DeploymentResponseGenerator)  # stream=True
            try:
                start = await stream.__anext__()
            except FAILED as exc:
                replica = BOOK.forget(stream.request_id)
                failure = f"{type(exc).__name__} on replica {replica}"
                log.warning("a replica failed before answering (%s): sending again", failure)
                continue
            return _relay(start, stream, checkable=producer is None)
        return error(f"no replica could take the request: {failure}", 503)


def _relay(
    start: Message, stream: DeploymentResponseGenerator, checkable: bool
) -> StreamingResponse:
    """`checkable` False: the answer's cached tokens include blocks pulled from a prefill
    replica, not only the predicted hit."""
    status = int(start["status"])
    headers = [(k, v) for k, v in start.get("headers", ()) if k.lower() not in NOT_RELAYED]
    replica = BOOK.replica(stream.request_id)
    if replica is not None:  # which replica answered: for logs, and for tests that check routing
        headers.append((REPLICA_HEADER, replica.encode()))
    is_stream = any(k.lower() == b"content-type" and b"event-stream" in v for k, v in headers)
    body = _body(stream, status, is_stream, checkable)
    response = StreamingResponse(body, status_code=status)
    response.raw_headers = headers
    return response


async def _body(
    stream: DeploymentResponseGenerator, status: int, is_stream: bool, checkable: bool
) -> AsyncIterator[bytes]:
    watch = CachedTokens()
    ended = False
    try:
        async for message in stream:
            if message["type"] != "http.response.body":
                continue
            chunk = message.get("body", b"")
            watch.feed(chunk)
            if chunk:
                yield chunk
            if not message.get("more_body"):
                ended = True
                break
    except FAILED as exc:
        log.warning("a replica broke off an answer: %s", exc)
        if is_stream:
            message_text = f"the replica broke off the answer: {type(exc).__name__}"
            err: dict[str, Any] = {
                "error": {"message": message_text, "type": "internal_server_error"}
            }
            yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
    finally:
        if not ended:  # the client left, or the replica failed: the replica aborts it
            stream.cancel()
        BOOK.answered(stream.request_id, status, watch.cached, checkable)
