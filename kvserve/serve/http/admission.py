"""How a client request enters the engine's queue: its `priority`, and its end when the
client leaves.

vLLM's `priority` field: an integer, lower is admitted earlier, honoured under
`--scheduling-policy priority`; under the default fcfs policy only 0 (or null)
is accepted, as vLLM answers. It is checked here, before any prompt is
tokenized. Whatever the policy, the engine admits round-robin between client
requests (kvserve.engine.waiting_queue), so a batch cannot starve the single
requests queued after it.

`until_disconnected` runs a handler's work while watching the connection:
when the client leaves (before or during the answer), the work is cancelled,
and its own cleanup (a `finally` that aborts its engine requests) frees the
engine at once, instead of computing answers nobody reads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import Request

from kvserve.sampling_params import INT64_MAX, INT64_MIN
from kvserve.serve.http.errors import APIError

T = TypeVar("T")
DISCONNECT_POLL_SECONDS = 0.5


def request_priority(body: dict[str, Any], policy: str) -> int:
    """The body's `priority` (default 0); a 400 naming it when it is not an integer in
    range, or not 0 while the server schedules fcfs."""
    value = body.get("priority")
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or not INT64_MIN <= value <= INT64_MAX:
        raise APIError("priority must be a signed 64-bit integer", param="priority")
    if value and policy != "priority":
        raise APIError(
            f"priority {value} needs a server started with --scheduling-policy priority "
            "(this one schedules fcfs: priority must be 0)",
            param="priority",
        )
    return value


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; if the client disconnects first, `work` is cancelled (its cleanup
    runs) and the answer is a 499 nobody reads."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise APIError("the client disconnected", 499)
    finally:
        if not task.done():  # this handler itself was cancelled
            task.cancel()
