"""The FastAPI application: every route, the API key check, and the small endpoints.

Each API's handlers live in their own room (openai/: chat, completions,
embeddings, /tokenize and /detokenize; responses_api/ and messages_api/ over the
same chat path, generation/; openai/adapters.py: loading and unloading LoRA
adapters); this file wires them up with /v1/models, /health, /metrics,
/version, /kv-metadata and /openapi.json.
With an API key every route but /health and /metrics wants `Authorization:
Bearer KEY` or, as Anthropic's clients send it, `x-api-key: KEY` (compared in
constant time), so a load balancer can probe and scrape a protected server.
Request bodies pass http/limits.py's size and time limits first; tokenizer work
runs on the tokenizer's worker thread.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.serve.http.errors import APIError, error_response, install_error_handlers
from kvserve.serve.http.limits import BodyLimits
from kvserve.serve.http.openapi import openapi_document
from kvserve.serve.messages_api import routes as messages_api
from kvserve.serve.messages_api.output import error_body as anthropic_error
from kvserve.serve.openai import adapters, chat, completions, embeddings, tokens
from kvserve.serve.responses_api import routes as responses_api
from kvserve.serve.state import ServerState
from kvserve.version import version as installed_version

OPEN_PATHS = frozenset({"/health", "/metrics"})
MESSAGES_PATH = "/v1/messages"
"""Anthropic's API: its errors in Anthropic's body."""


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="kvserve", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)

    app.add_middleware(BodyLimits, limits=state.limits)
    if state.api_key is not None:  # outermost: a request without the key is not even read
        app.add_middleware(_KeyCheck, api_key=state.api_key)

    @app.get("/health")
    async def health() -> Response:
        """200 while serving; 503 once draining or once the engine died, so a load
        balancer stops sending."""
        return Response(status_code=200 if state.healthy else 503)

    @app.get("/openapi.json")
    async def openapi() -> dict[str, Any]:
        return openapi_document(installed_version())

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.metrics is None:
            raise APIError("metrics are off", 404)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": installed_version()}

    @app.get("/kv-metadata")
    async def kv_metadata() -> dict[str, Any]:
        """Hashing, groups and event endpoints, for a router (behind the key: it is no probe)."""
        if state.kv_metadata is None:
            raise APIError("this server has no KV metadata", 404)
        if state.adapters is None:
            return state.kv_metadata
        return {**state.kv_metadata, "lora_adapters": state.adapters.metadata()}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": state.served_name,
            "object": "model",
            "created": 0,
            "owned_by": "kvserve",
            "root": state.description,
            "parent": None,
            "max_model_len": state.max_model_len,
        }
        served = [] if state.adapters is None else state.adapters.served()
        cards = [
            {**card, "id": a.request.lora_name, "root": a.request.lora_path, "parent": a.parent}
            for a in served
        ]  # vLLM's cards for its LoRA modules
        return {"object": "list", "data": [card, *cards]}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        return await adapters.load_adapter(request, state)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        return await adapters.unload_adapter(request, state)

    @app.post("/v1/completions")
    async def create_completion(request: Request) -> Any:
        return await completions.completions(request, state)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Any:
        return await chat.chat_completions(request, state)

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Any:
        return await responses_api.create(request, state)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        return responses_api.retrieve(response_id, state)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        return responses_api.delete(response_id, state)

    @app.post("/v1/messages")
    async def create_message(request: Request) -> Any:
        return await messages_api.create(request, state)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(request: Request) -> Any:
        return await messages_api.count_tokens(request, state)

    @app.post("/v1/embeddings")
    async def create_embeddings(request: Request) -> Any:
        return await embeddings.embeddings(request, state)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        return await tokens.tokenize(request, state)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        return await tokens.detokenize(request, state)

    return app


class _KeyCheck:
    """Plain ASGI, not `@app.middleware`: Starlette's BaseHTTPMiddleware wraps `receive`,
    which hides a client's disconnect from the handler (and so its abort)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            headers = Headers(scope=scope)
            scheme, _, given = headers.get("authorization", "").partition(" ")
            bearer = scheme.lower() == "bearer" and hmac.compare_digest(
                given.strip().encode(), self.key
            )
            # Anthropic's clients send the key as `x-api-key` (as vLLM accepts it there)
            anthropic = hmac.compare_digest(headers.get("x-api-key", "").encode(), self.key)
            if not bearer and not anthropic:
                message = "a valid API key is required (Authorization: Bearer KEY)"
                response = error_response(APIError(message, 401))
                if scope["path"].startswith(MESSAGES_PATH):
                    response = JSONResponse(anthropic_error(message, 401), 401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
