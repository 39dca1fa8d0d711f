"""One HTTP request carried over a Ray call: the ingress sends its ASGI scope and body, the
replica runs it through `kvserve serve`'s own app and sends the ASGI messages back.

Why not Serve's FastAPI ingress on the engine deployment: Serve's proxy hands an ingress
deployment's request router no body, and an exact prediction needs the prompt. So a thin
ingress deployment reads the body and calls the engine deployment through a handle, whose
request router (router.py) sees `(scope, body)`; on the replica the request is answered by
the same handlers as `kvserve serve` (kvserve.serve.app), streaming included: every message
the app sends is yielded as it comes. A caller that goes away (the client left) cancels the
call; the app then hears `http.disconnect`, as from uvicorn, and aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

from starlette.types import ASGIApp, Message

log = logging.getLogger("kvserve.ray")
SCOPE_KEYS = ("http_version", "method", "scheme", "path", "raw_path", "query_string", "headers")
"""What of the ingress's scope travels: the request itself (no app, state or extensions)."""
ABORT_GRACE_SECONDS = 2.0
"""After the caller left: time for the app to hear it and abort its request."""


def app_path(scope: Mapping[str, Any]) -> str:
    """The request's path under the application's route prefix (Serve's proxy keeps the whole
    path and puts the prefix in `root_path`): `/v1/chat/completions` whatever the prefix."""
    path, root = str(scope.get("path", "")), str(scope.get("root_path", "")).rstrip("/")
    if not root or not (path == root or path.startswith(f"{root}/")):
        return path
    return path[len(root) :] or "/"


def forwarded_scope(scope: Mapping[str, Any]) -> dict[str, Any]:
    """Plain data for the call: the request line and headers, the client's address. The path
    is the application's own (app_path): the replica's app and the request router know
    nothing of where Serve mounted it."""
    out = {key: scope[key] for key in SCOPE_KEYS if key in scope}
    root = str(scope.get("root_path", "")).rstrip("/")
    if root and "path" in out:
        out["path"] = app_path(scope)
        raw = out.get("raw_path")
        if isinstance(raw, bytes) and out["path"] != scope["path"]:
            out["raw_path"] = raw[len(root.encode()) :] or b"/"
    out["headers"] = [(bytes(k), bytes(v)) for k, v in scope.get("headers", ())]
    out.update(type="http", asgi={"version": "3.0"}, root_path="")
    if scope.get("client"):
        out["client"] = tuple(scope["client"])
    return out


async def run_asgi(app: ASGIApp, scope: dict[str, Any], body: bytes) -> AsyncIterator[Message]:
    """`app`'s answer to one request, message by message (http.response.start, then bodies)."""
    messages: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await messages.put(message)

    task = asyncio.ensure_future(app(dict(scope), receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    started = finished = False
    try:
        while (message := await messages.get()) is not None:
            started = started or message["type"] == "http.response.start"
            yield message
            if message["type"] == "http.response.body" and not message.get("more_body"):
                finished = True
                break
        if not started and task.done() and not task.cancelled() and task.exception():
            exc = task.exception()
            log.error("the app failed before answering: %r", exc)
            yield {"type": "http.response.start", "status": 500, "headers": []}
            yield {"type": "http.response.body", "body": b"internal error", "more_body": False}
    finally:
        gone.set()
        if not finished:  # the caller left: the app aborts the request (it hears a disconnect)
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(task), ABORT_GRACE_SECONDS)
            task.cancel()
