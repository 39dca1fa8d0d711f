"""`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`: vLLM's run-time LoRA routes.

Loading reads the adapter's files and checks its weights against the base model:
that runs on the engine thread (EngineThread.load_adapter, between two steps), and
the handler awaits it, so the event loop never reads a file. A bad adapter is a 400
naming what is wrong and leaves everything served as it was. Unloading takes the
name out of the table at once (its next request is a 404); requests already
submitted with it finish with it. Both answer plain text, as vLLM's do.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import PlainTextResponse

from kvserve.serve.http.adapters import ServedAdapters
from kvserve.serve.http.engine_thread import EngineDead
from kvserve.serve.http.errors import APIError
from kvserve.serve.request import protocol
from kvserve.serve.state import ServerState

LOAD_FIELDS = frozenset({"lora_name", "lora_path"})
UNLOAD_FIELDS = frozenset({"lora_name", "lora_int_id"})


async def load_adapter(request: Request, state: ServerState) -> PlainTextResponse:
    adapters = _adapters(state)
    body = protocol.parse_json(await request.body())
    protocol.check_fields(body, LOAD_FIELDS)
    name, path = _string(body, "lora_name"), _string(body, "lora_path")
    try:
        lora = adapters.reserve(name, path)
    except ValueError as exc:
        raise APIError(str(exc), param="lora_name") from None
    try:
        adapter = await state.engine.load_adapter(lora)
    except ValueError as exc:
        raise APIError(str(exc), param="lora_path") from None
    except EngineDead as exc:
        raise APIError(str(exc), 503) from None
    except RuntimeError as exc:
        raise APIError(str(exc), 500) from None
    finally:
        adapters.release(name)  # a no-op once added
    adapters.add(lora, adapter.identity)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_adapter(request: Request, state: ServerState) -> PlainTextResponse:
    adapters = _adapters(state)
    body = protocol.parse_json(await request.body())
    protocol.check_fields(body, UNLOAD_FIELDS)
    name = _string(body, "lora_name")
    if adapters.get(name) is None:
        served = ", ".join(repr(n) for n in adapters.names()[:20]) or "none"
        raise APIError(
            f"no LoRA adapter {name[:200]!r} is loaded (loaded: {served})", param="lora_name"
        )
    adapters.remove(name)
    state.engine.forget_adapter(name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def _adapters(state: ServerState) -> ServedAdapters:
    if state.adapters is None:
        raise APIError("LoRA adapters are off: start the server with --enable-lora", 404)
    return state.adapters


def _string(body: dict[str, object], name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value.strip():
        raise APIError(f"{name} must be a non-empty string", param=name)
    if len(value) > 4096:
        raise APIError(f"{name} is {len(value)} characters; at most 4096", param=name)
    return value
