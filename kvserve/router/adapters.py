"""LoRA adapters behind the router: load and unload on every replica, and who serves which.

`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` go to every replica
that is up (prefill engines included: they compute adapter prompts too), one
change at a time. A load that fails on one replica is undone on those where it
succeeded (no adapter half served) and answered with that replica's own error;
an unload succeeds once the replicas that answered no longer serve the name.
After either, each replica's `lora_adapters` is read anew from its /kv-metadata:
the router hashes an adapter request's blocks with the content identity read
there (kvserve.router.prompts.adapter_identities), and an adapter request goes
only to replicas that list the adapter (one that was down during a load, or
restarted, does not, and gets none of its requests).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
from fastapi import Request, Response

from kvserve.router.errors import error
from kvserve.router.health import read_info
from kvserve.router.replicas import Replica
from kvserve.router.state import RouterState

log = logging.getLogger("kvserve.router")
ADAPTER_TIMEOUT_SECONDS = 300.0
"""A replica reads and checks the adapter's files before it answers a load."""


async def change_adapter(request: Request, state: RouterState, raw: bytes) -> Response:
    """Load or unload (by the request's path) on every replica that is up."""
    path = request.url.path
    replicas = [r for r in state.replicas if r.healthy]
    if not replicas:
        return error("no replica is healthy", 503)
    async with state.adapter_lock:  # one change at a time: an undo meets no other change
        answers = await asyncio.gather(*(_post(state, r, path, raw) for r in replicas))
        done = [r for r, a in zip(replicas, answers, strict=True) if _ok(a)]
        failed = next((a for a in answers if not _ok(a)), None)
        if path.endswith("/load_lora_adapter") and failed is not None and done:
            await _undo(state, done, raw)
            done = []
        await asyncio.gather(*(refresh(state, r) for r in replicas))
    if failed is not None and not (path.endswith("/unload_lora_adapter") and done):
        return _relayed(failed)
    return _relayed(answers[replicas.index(done[0])])


def serving(state: RouterState, body: Any) -> set[int] | None:
    """The replicas that list the adapter a request's `model` names; None when it names no
    adapter any replica lists (the base model, or a name they will refuse themselves)."""
    model = body.get("model") if isinstance(body, dict) else None
    if not isinstance(model, str):
        return None
    listed = {
        r.index
        for r in state.replicas
        if any(
            isinstance(e, dict) and e.get("name") == model
            for e in r.info.get("lora_adapters") or ()
        )
    }
    return listed or None


async def refresh(state: RouterState, replica: Replica) -> None:
    """Read the replica's adapters anew (the rest of what it said stays as read)."""
    info = await read_info(state, replica, "its adapters could not be read")
    if info is None:
        return
    replica.info = {**replica.info, "lora_adapters": info.get("lora_adapters") or []}


async def _post(
    state: RouterState, replica: Replica, path: str, raw: bytes
) -> httpx.Response | str:
    try:
        return await state.http().post(
            f"{replica.url}{path}",
            content=raw,
            headers={"content-type": "application/json"},
            timeout=ADAPTER_TIMEOUT_SECONDS,
        )
    except httpx.HTTPError as exc:
        return f"{replica.url}: {type(exc).__name__}: {exc}"


def _ok(answer: httpx.Response | str) -> bool:
    return isinstance(answer, httpx.Response) and answer.status_code == 200


async def _undo(state: RouterState, replicas: list[Replica], raw: bytes) -> None:
    try:
        name = json.loads(raw).get("lora_name")
    except (ValueError, AttributeError):
        return
    body = json.dumps({"lora_name": name}).encode()
    for replica, answer in zip(
        replicas,
        await asyncio.gather(*(_post(state, r, "/v1/unload_lora_adapter", body) for r in replicas)),
        strict=True,
    ):
        if not _ok(answer):
            log.warning("replica %s keeps adapter %r: its undo failed", replica.url, name)


def _relayed(answer: httpx.Response | str) -> Response:
    if isinstance(answer, str):
        return error(f"a replica could not be reached: {answer}", 503)
    kept = {k: v for k, v in answer.headers.items() if k.lower() == "content-type"}
    return Response(answer.content, status_code=answer.status_code, headers=kept)
