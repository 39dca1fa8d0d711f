"""The router's FastAPI app: OpenAI's routes on several replicas, and its own small endpoints.

POST /v1/completions, /v1/chat/completions and /v1/embeddings are
tokenized, their hits predicted and forwarded (forward.py; an embedding's
hit counts on replicas with `last` pooling, whose prompt blocks are shared
and evented like any prompt's); /v1/models, /tokenize and /detokenize
are forwarded without a prediction; POST /v1/load_lora_adapter and
/v1/unload_lora_adapter go to every replica (adapters.py). /health is 200 while some replica can
take a request and the router is not draining; /metrics is the router's own
registry. With an API key every route but /health and /metrics wants it, as
on the replicas; the request then goes on with the same header. A body
larger than `max_request_bytes` is a 413, a body the replicas would refuse
before tokenizing it (JSON too deep, too many or too long prompts, n) a 400,
both before the router tokenizes anything (limits.py); every answer of the
router's own is OpenAI's error body (errors.py). A long body is tokenized on a
thread of its own, one at a time (state.py): short ones never wait behind it; a
client gone while its prompt was tokenized has nothing sent to a replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future
from functools import partial
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from kvserve.request_limits import LimitError, decode_body
from kvserve.router import health
from kvserve.router.adapters import change_adapter, serving
from kvserve.router.disaggregated import disaggregated, prefill_first
from kvserve.router.errors import error, install_error_handlers
from kvserve.router.forward import GONE_STATUS, ClientGone, Prediction, forward, unless_gone
from kvserve.router.limits import check_request, read_body
from kvserve.router.prompts import Endpoint, adapter_identities, extra_keys, prompt_token_ids
from kvserve.router.replicas import headers
from kvserve.router.state import SHORT_BODY_BYTES, RouterState
from kvserve.version import version as installed

log = logging.getLogger("kvserve.router")
PREDICT_TIMEOUT_SECONDS = 10.0
"""Past this a request goes on without a prediction (the follower is stuck on a replica)."""


def create_app(state: RouterState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.client = httpx.AsyncClient(
            headers=headers(state.api_key),
            timeout=httpx.Timeout(None, connect=5.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        watcher = asyncio.create_task(health.watch(state))
        try:
            yield
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            await state.client.aclose()

    app = FastAPI(
        title="kvserve router", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )
    install_error_handlers(app)

    @app.get("/health")
    async def health_check() -> Response:
        up = any(r.available for r in state.replicas)
        return Response(status_code=200 if up and not state.draining else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version(request: Request) -> Response:
        if (denied := _unauthorized(request, state)) is not None:
            return denied
        return JSONResponse({"version": installed()})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(request, state, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(request, state, "chat")

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await _generate(request, state, "embeddings")

    @app.post("/v1/load_lora_adapter")
    @app.post("/v1/unload_lora_adapter")
    async def lora_adapter(request: Request) -> Response:
        if (denied := _refused(request, state)) is not None:
            return denied
        raw = await read_body(request, state.max_request_bytes)
        return raw if isinstance(raw, Response) else await change_adapter(request, state, raw)

    @app.get("/v1/models")
    @app.post("/tokenize")
    @app.post("/detokenize")
    async def passed_on(request: Request) -> Response:
        return denied if (denied := _refused(request, state)) else await _plain(request, state)

    return app


def _unauthorized(request: Request, state: RouterState) -> Response | None:
    """401 without the key (compared in constant time)."""
    if state.api_key is not None:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode(), state.api_key.encode()
        ):
            return error("a valid API key is required (Authorization: Bearer KEY)", 401)
    return None


def _refused(request: Request, state: RouterState) -> Response | None:
    """401 without the key; 503 (with Retry-After) while draining."""
    if (denied := _unauthorized(request, state)) is not None:
        return denied
    if state.draining:
        return error("the router is shutting down", 503)
    return None


async def _plain(request: Request, state: RouterState) -> Response:
    raw = await read_body(request, state.max_request_bytes)
    if isinstance(raw, Response):
        return raw
    return await forward(request, state, raw, Prediction(checked=False))


async def _generate(request: Request, state: RouterState, endpoint: Endpoint) -> Response:
    if (denied := _refused(request, state)) is not None:
        return denied
    raw = await read_body(request, state.max_request_bytes)
    if isinstance(raw, Response):
        return raw
    try:
        body = decode_body(raw)
        check_request(state.limits, endpoint, body)
    except LimitError as exc:
        return error(exc.message, 400, param=exc.param)
    try:  # a client gone while its prompt is tokenized (or prefilled): nothing is sent
        prediction = await unless_gone(request, _predict(state, endpoint, body, len(raw)))
        if endpoint != "embeddings" and disaggregated(state):
            path = request.url.path
            await unless_gone(request, prefill_first(request, state, path, body, prediction))
    except ClientGone:
        return Response(status_code=GONE_STATUS)
    return await forward(request, state, raw, prediction, serving(state, body))


def _tokenized(state: RouterState, started: float, done: Future[Any]) -> None:
    """The tokenizer thread's time (queue included), also for a client that left meanwhile."""
    if not done.cancelled():
        state.metrics.tokenize_seconds.observe(time.perf_counter() - started)


async def _predict(state: RouterState, endpoint: Endpoint, body: Any, size: int) -> Prediction:
    """The prompts' tokens and each replica's hit; none when the body is not understood,
    when a prompt is longer than the replicas take (matching is bounded by their limits),
    or when it is long (`size` bytes) and another long one is being tokenized.
    An embedding's answer reports no cached tokens: its hit steers, and is not checked."""
    infos = [r.info for r in state.replicas]
    extra = extra_keys(body, infos[0].get("served_model_name"), adapter_identities(infos))
    if extra is None:
        return Prediction()  # an adapter the router does not know: routed by load
    if size <= SHORT_BODY_BYTES:
        thread, tokenizer = state.tokenizer_thread, state.tokenizer
    elif state.long_lane_free():
        thread, tokenizer = state.long_thread, state.long_tokenizer
    else:
        return Prediction()
    started = time.perf_counter()
    sync = asyncio.wrap_future(state.follower.sync())  # its round trip overlaps tokenizing
    work = thread.submit(prompt_token_ids, tokenizer, endpoint, body)
    work.add_done_callback(partial(_tokenized, state, started))
    if thread is state.long_thread:
        state.long_work = work  # busy until the thread is done, even if the client leaves
    try:
        prompts = await asyncio.wrap_future(work)  # cancelled: taken off the queue if not begun
    except asyncio.CancelledError:
        sync.cancel()
        raise
    except Exception as exc:  # a template that fails: the replica will say why
        log.debug("no prediction: %s", exc)
        prompts = None
    tokenized = time.perf_counter()
    longest = state.limits.max_model_len if state.limits is not None else None
    if prompts is None or (longest is not None and any(len(p) >= longest for p in prompts)):
        sync.cancel()  # a prompt the replica refuses is not matched: no work for nothing
        return Prediction()
    try:
        synced = await asyncio.wait_for(sync, PREDICT_TIMEOUT_SECONDS)
        hits = await asyncio.wait_for(
            asyncio.wrap_future(state.follower.predict(prompts, extra, synced)),
            PREDICT_TIMEOUT_SECONDS,
        )
    except TimeoutError:
        log.warning("no prediction: the event follower did not answer in time")
        hits = {}
    state.metrics.predict_seconds.observe(time.perf_counter() - tokenized)
    num_tokens = sum(len(p) for p in prompts)
    if endpoint == "embeddings":
        shared = [hits.get(r.index) if r.shares_embedding_prompts else 0 for r in state.replicas]
        return Prediction(num_tokens, shared, checked=False)
    hit = [hits.get(r.index) if r.caching else 0 for r in state.replicas]
    return Prediction(num_tokens, hit, prompts=prompts, extra=extra)
