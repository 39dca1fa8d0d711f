"""Forwarding one request: choose a replica, send the body unchanged, relay the answer unbuffered.

The answer's bytes go to the client as they come, untouched. The first one
is awaited before the client sees anything, so a replica that refuses the
connection or drops it before answering costs nothing but a retry: the
request is sent once more, to another replica (the failed one is marked
down until its /health answers again). A replica that answers 503 (it is
draining, or its queue is full) while another could take the request is
not relayed either: the request goes to another, and the refusing replica
gets nothing new until its /health answers 200 again (health.py). After the
first byte, a broken answer is the client's to see (a stream ends with an
error event).

A client that leaves before the first byte (a non-streamed answer comes
whole at the end) is noticed at once: the connection to the replica is
closed, which makes the replica abort the request instead of finishing it
for nobody. After the first byte the relay notices it (Starlette listens).

Loads are kept here: `running` from sending to the answer's end,
`queued_prefill_tokens` (prompt tokens less the predicted hit) until its
first byte, when the replica has run the prefill. The predicted hit is
compared with the `cached_tokens` the answer reports (its last
`"cached_tokens": N` in the bytes: a JSON string cannot hold that pattern
unescaped).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvserve.router.errors import error
from kvserve.router.health import mark_down, mark_refusing
from kvserve.router.limits import bounded
from kvserve.router.replicas import Replica
from kvserve.router.state import RouterState

log = logging.getLogger("kvserve.router")
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
     "transfer-encoding", "upgrade"}
)  # fmt: skip
NOT_SENT = HOP_BY_HOP | {"host", "content-length"}
"""Request headers httpx sets itself."""
NOT_RELAYED = HOP_BY_HOP | {"date", "server"}
"""Response headers uvicorn sets itself."""
T = TypeVar("T")
GONE_STATUS = 499
"""What a request whose client left is counted as (nginx's "client closed request")."""
CACHED = re.compile(rb'"cached_tokens":\s*(\d+)')
TAIL = 64
"""Bytes kept from the previous chunk, so a match split between chunks is seen."""


@dataclass(slots=True)
class Prediction:
    """A request's prompt tokens and, per replica, its predicted hit (None: unknown)."""

    num_tokens: int = 0
    hits: list[int | None] = field(default_factory=list)
    checked: bool = True
    """Compare the answer's cached tokens with the hit (False: not a generation request)."""
    prompts: list[list[int]] | None = None
    """The prompts' token ids, matched again once a prefill engine has run them."""
    extra: Any = None
    """Their extra keys (LoRA, cache salt), as matched."""

    def hit(self, replica: int) -> int:
        return (self.hits[replica] if replica < len(self.hits) else None) or 0


@dataclass(slots=True, frozen=True)
class _Refused:
    """The replica answered 503 and another replica may take the request."""

    reason: str


class ClientGone(Exception):
    """The client left before the answer's first byte."""


async def forward(
    request: Request,
    state: RouterState,
    raw: bytes,
    prediction: Prediction,
    only: set[int] | None = None,
) -> Response:
    """Send to the policy's choice; elsewhere if it fails before its first byte (once) or
    answers 503 (while another replica is available). Never to a prefill engine: it only
    ever runs prompts (disaggregated.py). `only`: the replicas that may take it (those
    serving the LoRA adapter it names)."""
    state.in_flight += 1  # until the relay closes, or now if there is none
    excluded = {r.index for r in state.replicas if r.role == "prefill"}
    if only is not None:
        excluded |= {r.index for r in state.replicas if r.index not in only}
    failure = "no replica is healthy"
    broken = 0
    while broken < 2:
        loads = [r.load(r.index in excluded) for r in state.replicas]
        hits = [prediction.hit(r.index) for r in state.replicas]
        try:
            choice = state.policy.choose(prediction.num_tokens, hits, loads)
        except ValueError:
            break
        replica = state.replicas[choice.replica]
        others = any(
            r.available and r is not replica and r.index not in excluded for r in state.replicas
        )
        try:
            answer = await _send(request, state, replica, raw, prediction, retry_503=others)
        except ClientGone:
            state.in_flight -= 1
            log.info("client left before the answer: the request on %s is aborted", replica.url)
            return Response(status_code=GONE_STATUS)
        except BaseException:
            state.in_flight -= 1
            raise
        if isinstance(answer, Response):
            return answer
        excluded.add(replica.index)
        state.metrics.retries.labels(replica.url).inc()
        if isinstance(answer, _Refused):
            failure = answer.reason
            mark_refusing(replica, failure)
        else:
            failure = answer
            broken += 1
            mark_down(state, replica, failure)
    state.in_flight -= 1
    return error(f"no replica could take the request: {failure}", 503)


async def _send(
    request: Request,
    state: RouterState,
    replica: Replica,
    raw: bytes,
    prediction: Prediction,
    retry_503: bool,
) -> Response | _Refused | str:
    """The relayed answer, a 503 to retry elsewhere, or why the replica failed before its
    first byte; ClientGone if the client left first (the replica's connection closed)."""
    client = state.http()
    label = replica.url
    predicted = prediction.hits[replica.index] if prediction.hits else None
    prefill = max(prediction.num_tokens - (predicted or 0), 0)
    replica.running += 1
    replica.queued_prefill_tokens += prefill
    state.metrics.requests.labels(label).inc()
    if predicted is not None:
        state.metrics.predicted.labels(label).inc(predicted)
    headers = [(k, v) for k, v in request.headers.items() if k.lower() not in NOT_SENT]
    upstream_request = client.build_request(
        request.method,
        f"{replica.url}{request.url.path}",
        params=request.url.query or None,
        headers=headers,
        content=raw,
    )
    try:
        upstream, chunks, first = await unless_gone(request, _open(client, upstream_request))
    except BaseException as exc:
        replica.running -= 1
        if isinstance(exc, httpx.TransportError):
            return f"{replica.url}: {type(exc).__name__}: {exc}"
        raise
    finally:
        replica.queued_prefill_tokens -= prefill
    if upstream.status_code == 503 and retry_503:
        replica.running -= 1
        await upstream.aclose()
        return _Refused(f"{replica.url} answered 503")
    watch = _Watch(status=upstream.status_code, predicted=predicted, checked=prediction.checked)

    def done() -> None:
        replica.running -= 1
        state.in_flight -= 1
        watch.report(state, label)

    headers_out = {
        k: bounded(v) for k, v in upstream.headers.items() if k.lower() not in NOT_RELAYED
    }
    stream = "text/event-stream" in upstream.headers.get("content-type", "")
    return _Relay(
        _body(first, chunks, watch, replica.url, stream),
        status_code=upstream.status_code,
        headers=headers_out,
        upstream=upstream,
        on_close=done,
    )


async def _open(
    client: httpx.AsyncClient, upstream_request: httpx.Request
) -> tuple[httpx.Response, AsyncIterator[bytes], bytes]:
    """The replica's answer and its first bytes (closed again if they never come)."""
    upstream = await client.send(upstream_request, stream=True)
    try:
        chunks = upstream.aiter_raw()
        return upstream, chunks, await anext(chunks, b"")
    except BaseException:
        await upstream.aclose()
        raise


async def unless_gone(request: Request, work: Awaitable[T]) -> T:
    """`work`, cancelled (closing what it opened) with ClientGone if the client leaves first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        gone.cancel()
    if not task.cancelled():
        return task.result()
    raise ClientGone


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (its body was read whole before)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclass(slots=True)
class CachedTokens:
    """The last `"cached_tokens": N` in an answer's bytes, fed chunk by chunk."""

    cached: int | None = None
    tail: bytes = b""

    def feed(self, chunk: bytes) -> None:
        window = self.tail + chunk
        for match in CACHED.finditer(window):
            self.cached = int(match.group(1))
        self.tail = window[-TAIL:]


@dataclass(slots=True)
class _Watch(CachedTokens):
    """What passes through: the last cached_tokens. A client may close a stream as soon as
    it has `[DONE]`, before the replica's end of it: seeing the usage is what counts."""

    status: int = 0
    predicted: int | None = None
    checked: bool = True

    def report(self, state: RouterState, label: str) -> None:
        metrics = state.metrics
        if not self.checked:
            return
        if self.cached is not None:
            metrics.reported.labels(label).inc(self.cached)
        if self.status != 200 or self.cached is None or self.predicted is None:
            metrics.unverified.labels(label).inc()
        elif self.cached == self.predicted:
            metrics.exact.labels(label).inc()
        else:
            metrics.wrong.labels(label).inc()
            log.info(
                "predicted %d cached tokens on %s, it reported %d",
                self.predicted,
                label,
                self.cached,
            )


async def _body(
    first: bytes, chunks: AsyncIterator[bytes], watch: _Watch, url: str, stream: bool
) -> AsyncIterator[bytes]:
    if first:
        watch.feed(first)
        yield first
    try:
        async for chunk in chunks:
            watch.feed(chunk)
            yield chunk
    except httpx.TransportError as exc:
        log.warning("replica %s broke off an answer: %s", url, exc)
        if stream:  # say so, as a replica says it when its engine fails
            message = f"the replica broke off the answer: {type(exc).__name__}"
            error = {"error": {"message": message, "type": "internal_server_error"}}
            yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
        return


class _Relay(StreamingResponse):
    """Closes the upstream answer and settles the books however the relay ends
    (finished, client gone, or cancelled)."""

    def __init__(
        self, content: AsyncIterator[bytes], *, upstream: httpx.Response,
        on_close: Callable[[], None], **kwargs: Any,
    ) -> None:  # fmt: skip
        super().__init__(content, **kwargs)
        self.upstream = upstream
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.upstream.aclose()
            self.on_close()
