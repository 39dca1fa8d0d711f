"""The handlers: POST /v1/messages and /v1/messages/count_tokens, errors in Anthropic's shape."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvserve.serve.generation import prompts, stream, submit
from kvserve.serve.generation.chat_blocks import StreamReader, whole_answer
from kvserve.serve.generation.job import Job
from kvserve.serve.http.admission import until_disconnected
from kvserve.serve.http.engine_thread import ServerStopping
from kvserve.serve.http.errors import APIError
from kvserve.serve.messages_api import output
from kvserve.serve.messages_api.output import MessageShape
from kvserve.serve.messages_api.request import translate
from kvserve.serve.request import fields, protocol
from kvserve.serve.responses_api.output import new_id
from kvserve.serve.state import ServerState


async def create(request: Request, state: ServerState) -> Any:
    return await _anthropic_errors(lambda: _create(request, state))


async def count_tokens(request: Request, state: ServerState) -> Any:
    return await _anthropic_errors(lambda: _count(request, state))


async def _anthropic_errors(handler: Callable[[], Awaitable[Any]]) -> Any:
    try:
        return await handler()
    except APIError as exc:
        body = output.error_body(exc.message[:1000], exc.status)
        return JSONResponse(body, exc.status, headers=exc.headers)


async def _create(request: Request, state: ServerState) -> Any:
    body = protocol.parse_json(await request.body())
    chat, ignored = translate(body)
    prompt = await prompts.chat_prompt(state, chat)
    job = await submit.start_chat(state, chat, prompt, request)
    state.ignored_log.note(ignored)
    headers = fields.header([*ignored, *prompt.ignored])
    shape = MessageShape(new_id("msg"), prompt.model, chat.get("stop") or [])
    if job.options.stream:
        events = _events(job, state, shape)
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    answer = whole_answer(await stream.collect(request, job, state))
    return JSONResponse(shape.body(answer), headers=headers)


async def _count(request: Request, state: ServerState) -> dict[str, int]:
    body = protocol.parse_json(await request.body())
    chat, _ = translate(body, count_only=True)
    prompt = await until_disconnected(request, prompts.chat_prompt(state, chat))
    return {"input_tokens": len(prompt.ids)}


async def _events(job: Job, state: ServerState, shape: MessageShape) -> AsyncIterator[str]:
    reader = StreamReader()
    started = False
    try:
        async with aclosing(stream.chunks(job, state)) as chunks:  # a client gone: abort
            async for chunk in chunks:
                pieces = reader.feed(chunk)
                if not started and pieces:  # after the first step: usage counts the cache hit
                    started = True
                    yield output.start_event(shape, reader.answer.usage)
                for piece in pieces:
                    yield output.piece_event(piece)
        if not started:
            yield output.start_event(shape, reader.answer.usage)
        for piece in reader.close():
            yield output.piece_event(piece)
        for event in output.end_events(shape, reader.answer):
            yield event
    except (RuntimeError, ServerStopping, APIError) as exc:
        status = exc.status if isinstance(exc, APIError) else 500
        body = output.error_body(str(exc), status)
        yield f"event: error\ndata: {json.dumps(body)}\n\n"
