"""The handlers: POST /v1/responses, GET and DELETE /v1/responses/{id}."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing, contextmanager
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvserve.serve.generation import prompts, stream, submit
from kvserve.serve.generation.chat_blocks import StreamReader, whole_answer
from kvserve.serve.generation.job import Job
from kvserve.serve.http.engine_thread import ServerStopping
from kvserve.serve.http.errors import APIError
from kvserve.serve.request import fields, protocol
from kvserve.serve.responses_api.output import EventWriter, ResponseShape, new_id
from kvserve.serve.responses_api.request import PARAMS, Translated, translate
from kvserve.serve.responses_api.store import StoredResponse
from kvserve.serve.state import ServerState


async def create(request: Request, state: ServerState) -> Any:
    body = protocol.parse_json(await request.body())
    store = state.responses
    history: list[dict[str, Any]] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        stored = store.get(previous) if isinstance(previous, str) else None
        if stored is None:
            raise APIError(
                f"no stored response {str(previous)[:80]!r}",
                404,
                param="previous_response_id",
            )
        history = stored.conversation
    translated = translate(body, history)
    keep = protocol.flag(body, "store", default=True)
    with chat_params():
        prompt = await prompts.chat_prompt(state, translated.chat)
        job = await submit.start_chat(state, translated.chat, prompt, request)
    state.ignored_log.note(translated.ignored)
    headers = fields.header([*translated.ignored, *prompt.ignored])
    shape = ResponseShape(new_id("resp"), int(time.time()), prompt.model, body)
    if job.options.stream:
        events = _events(job, state, shape, translated, keep)
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    answer = whole_answer(await stream.collect(request, job, state))
    result = shape.body(answer)
    if keep:
        conversation = [*translated.conversation, answer.assistant_message()]
        store.put(shape.id, StoredResponse(result, conversation))
    return JSONResponse(result, headers=headers)


@contextmanager
def chat_params() -> Iterator[None]:
    """The chat path's errors name chat's fields; the client knows the Responses API's."""
    try:
        yield
    except APIError as exc:
        exc.param = PARAMS.get(exc.param or "", exc.param)
        raise


async def _events(
    job: Job, state: ServerState, shape: ResponseShape, translated: Translated, keep: bool
) -> AsyncIterator[str]:
    writer = EventWriter(shape)
    reader = StreamReader()
    for event in writer.opening():
        yield event
    try:
        async with aclosing(stream.chunks(job, state)) as chunks:  # a client gone: abort
            async for chunk in chunks:
                for piece in reader.feed(chunk):
                    for event in writer.piece(piece):
                        yield event
    except (RuntimeError, ServerStopping, APIError) as exc:
        yield writer.error(str(exc))
        return
    for piece in reader.close():
        for event in writer.piece(piece):
            yield event
    event, result = writer.closing(reader.answer)
    if keep:
        conversation = [*translated.conversation, reader.answer.assistant_message()]
        state.responses.put(shape.id, StoredResponse(result, conversation))
    yield event


def retrieve(response_id: str, state: ServerState) -> dict[str, Any]:
    stored = state.responses.get(response_id)
    if stored is None:
        raise APIError(f"no stored response {response_id[:80]!r}", 404)
    return stored.body


def delete(response_id: str, state: ServerState) -> dict[str, Any]:
    if not state.responses.delete(response_id):
        raise APIError(f"no stored response {response_id[:80]!r}", 404)
    return {"id": response_id, "object": "response", "deleted": True}
