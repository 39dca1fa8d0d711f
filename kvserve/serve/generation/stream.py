"""A submitted request's answer: joined into one JSON body, or streamed as Server-Sent Events.

`answer` picks by the request's `stream`: `collect` joins every delta (the client
leaving meanwhile aborts it), `chunks` yields the stream's chunk bodies (a consumer
that stops reading aborts the engine's work) and the SSE stream wraps them. The
Responses and Messages APIs read the same two (`collect`, `chunks`) and translate.
A request the engine fails alone (its output carries the error) is a 500, or an
error event in a stream already started; the bodies themselves are built by the
Job (generation/job.py).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvserve.outputs import RequestOutput
from kvserve.serve.generation.job import Job
from kvserve.serve.generation.submit import ClientGone, abort, watch
from kvserve.serve.http.engine_thread import ServerStopping
from kvserve.serve.http.errors import APIError, error_body
from kvserve.serve.request import structured
from kvserve.serve.state import ServerState


async def answer(request: Request, state: ServerState, job: Job, headers: dict[str, str]) -> Any:
    """The HTTP answer: SSE chunks, or the whole body once every choice finished."""
    if job.options.stream:
        events = _events(job, state)
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    return JSONResponse(await collect(request, job, state), headers=headers)


async def collect(request: Request, job: Job, state: ServerState) -> dict[str, Any]:
    """Join the deltas; the request is aborted if the client leaves while it runs."""
    watcher = asyncio.create_task(watch(request, job, state))
    try:
        async for output in _outputs(job):
            job.add(output)
    except ClientGone:
        raise APIError("the client disconnected", 499) from None
    except ServerStopping as exc:
        raise APIError(str(exc), 503) from None
    except GrammarFailed as exc:
        abort(job, state)
        raise exc.error from None
    except RuntimeError as exc:  # the engine failed a prompt, or died: the others stop too
        abort(job, state)
        raise APIError(str(exc), 500) from None
    finally:
        watcher.cancel()
    return job.body()


async def chunks(job: Job, state: ServerState) -> AsyncGenerator[dict[str, Any], None]:
    """The stream's chunk bodies: (chat) the role first, each delta, finish_reason last, then
    usage when asked. The engine's failure raises (RuntimeError; ServerStopping when the
    server stops); a consumer that stops reading aborts the engine's work."""
    finished = False
    try:
        first = job.first_chunk()
        if first is not None:
            yield first
        async for output in _outputs(job):
            chunk = job.delta_chunk(output)
            if chunk is not None:
                yield chunk
        finished = True
        if job.options.include_usage:
            yield job.chunk([], job.usage())
    except ServerStopping:
        finished = True  # the engine already dropped it
        raise
    finally:
        if not finished:  # the client went away, or the engine failed: free the engine's work
            abort(job, state)


async def _events(job: Job, state: ServerState) -> AsyncIterator[str]:
    """SSE: each chunk, an abort chunk or an error event at a failure, then [DONE]."""
    try:
        async with aclosing(chunks(job, state)) as stream:  # closed (aborted) with this one
            async for chunk in stream:
                yield sse(chunk)
    except ServerStopping:  # end each open choice as aborted
        yield sse(job.abort_chunk())
    except GrammarFailed as exc:
        yield sse(error_body(exc.error.message, 400, exc.error.param))
    except RuntimeError as exc:
        yield sse(error_body(str(exc), 500))
    yield "data: [DONE]\n\n"


def sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def _outputs(job: Job) -> AsyncIterator[RequestOutput]:
    """Every output of every prompt, the early ones first, until all have finished."""
    early, job.early = job.early, []
    unfinished = len(job.parts)
    pending: list[RequestOutput | BaseException] = list(early)
    while unfinished:
        item = pending.pop(0) if pending else await job.outputs.get()
        if isinstance(item, BaseException):
            raise item
        if item.error is not None:
            failed = structured.compile_failure(item.error, job.constraint)
            if failed is not None:
                raise GrammarFailed(failed)
            raise RuntimeError(f"the engine failed this request: {item.error}")
        part = job.parts[item.request_id]
        if item.finished:
            part.finished = True
            unfinished -= 1
        yield item


class GrammarFailed(RuntimeError):
    """The request's own grammar failed it after its first token (a dead end the compile
    could not see): the client's constraint, so a 400 (an error event once streaming)."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.message)
        self.error = error
