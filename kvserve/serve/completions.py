"""`POST /v1/completions` and `POST /v1/chat/completions`: one request, answered or streamed.

Both run the same way: the engine thread gets the request with DELTA outputs
(pieces of text that never split a UTF-8 character and add up to the final
text exactly), the handler reads them from the request's asyncio queue, and
either joins them (one JSON answer) or sends each as a Server-Sent Event. The
first output is awaited before a stream starts, so a request the engine
refuses is still a plain 400. A client that goes away aborts its request.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.serve import protocol
from kvserve.serve.errors import APIError
from kvserve.serve.state import ServerState

DISCONNECT_POLL_SECONDS = 0.5


@dataclass(slots=True)
class _Job:
    """One generation request as the handlers see it."""

    request_id: str
    chat: bool
    model: str
    created: int
    outputs: asyncio.Queue[RequestOutput | BaseException]
    first: RequestOutput

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        body: dict[str, Any] = {
            "id": self.request_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def completions(request: Request, state: ServerState) -> Any:
    body = protocol.parse_json(await request.body())
    protocol.check_fields(body, protocol.COMPLETION_FIELDS)
    state.check_model(body.get("model"))
    prompt = protocol.completion_prompt(body)
    return await _run(request, state, body, prompt, chat=False)


async def chat_completions(request: Request, state: ServerState) -> Any:
    from kvserve.chat_template import render

    body = protocol.parse_json(await request.body())
    protocol.check_fields(body, protocol.CHAT_FIELDS)
    state.check_model(body.get("model"))
    messages = protocol.chat_messages(body)
    tokenizer = state.engine.engine.tokenizer
    try:
        _, ids = await state.engine.call(lambda: render(tokenizer, messages))
    except ValueError as exc:  # no template, or an empty rendering: say so
        raise APIError(str(exc), param="messages") from None
    return await _run(request, state, body, ids, chat=True)


async def _run(
    request: Request, state: ServerState, body: dict[str, Any], prompt: Any, chat: bool
) -> Any:
    params = protocol.sampling_params(body)
    stream, include_usage = protocol.stream_flags(body)
    job = await _start(state, prompt, params, chat)
    if stream:
        return StreamingResponse(
            _events(job, state, params, include_usage), media_type="text/event-stream"
        )
    return JSONResponse(await _collect(request, job, state, params))


async def _start(state: ServerState, prompt: Any, params: SamplingParams, chat: bool) -> _Job:
    """Submit, and wait for the first output: the engine's refusal is a 400, not a broken stream."""
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    outputs = state.engine.submit(request_id, prompt, params)
    first = await outputs.get()
    if isinstance(first, BaseException):
        message = str(first)  # names the request id and counts, never the prompt's text
        raise APIError(message, param="max_tokens" if "max_tokens" in message else None)
    return _Job(request_id, chat, state.served_name, int(time.time()), outputs, first)


class _ClientGone(Exception):
    """Put on a request's queue when its client left: the handler stops waiting."""


async def _watch(request: Request, job: _Job, state: ServerState) -> None:
    """Poll for a disconnect while a plain (not streamed) request runs; abort it if so."""
    while True:
        await asyncio.sleep(DISCONNECT_POLL_SECONDS)
        if await request.is_disconnected():
            state.engine.abort(job.request_id)
            job.outputs.put_nowait(_ClientGone())
            return


async def _outputs(job: _Job) -> AsyncIterator[RequestOutput]:
    output: RequestOutput | BaseException = job.first
    while True:
        if isinstance(output, BaseException):
            raise output
        yield output
        if output.finished:
            return
        output = await job.outputs.get()


def _usage(output: RequestOutput, generated: int) -> dict[str, Any]:
    prompt_tokens = len(output.prompt_token_ids)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": generated,
        "total_tokens": prompt_tokens + generated,
        "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens},
    }


async def _collect(
    request: Request, job: _Job, state: ServerState, params: SamplingParams
) -> dict[str, Any]:
    """Join the deltas; the request is aborted if the client leaves while it runs."""
    texts = [""] * params.n
    finish: list[str | None] = [None] * params.n
    generated = 0
    last = job.first
    watcher = asyncio.create_task(_watch(request, job, state))
    try:
        async for last in _outputs(job):
            for c in last.outputs:
                texts[c.index] += c.text
                generated += len(c.token_ids)
                finish[c.index] = c.finish_reason or finish[c.index]
    except _ClientGone:
        raise APIError("the client disconnected", 499) from None
    except RuntimeError as exc:
        raise APIError(str(exc), 500) from None
    finally:
        watcher.cancel()
    choices: list[dict[str, Any]] = []
    for i, text in enumerate(texts):
        choice: dict[str, Any] = {"index": i, "finish_reason": finish[i], "logprobs": None}
        if job.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choices.append(choice)
    return {
        "id": job.request_id,
        "object": "chat.completion" if job.chat else "text_completion",
        "created": job.created,
        "model": job.model,
        "choices": choices,
        "usage": _usage(last, generated),
    }


async def _events(
    job: _Job, state: ServerState, params: SamplingParams, include_usage: bool
) -> AsyncIterator[str]:
    """SSE chunks: (chat) the role first, each delta, finish_reason last, usage, [DONE]."""
    finished = False
    generated = 0
    last = job.first
    try:
        if job.chat:
            yield job.chunk(
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    for i in range(params.n)
                ]
            )
        async for last in _outputs(job):
            choices = []
            for c in last.outputs:
                generated += len(c.token_ids)
                if not c.text and c.finish_reason is None:
                    continue
                choice: dict[str, Any] = {"index": c.index, "logprobs": None}
                if job.chat:
                    choice["delta"] = {"content": c.text} if c.text else {}
                else:
                    choice["text"] = c.text
                choice["finish_reason"] = c.finish_reason
                choices.append(choice)
            if choices:
                yield job.chunk(choices)
        finished = True
        if include_usage:
            yield job.chunk([], _usage(last, generated))
    except RuntimeError as exc:
        finished = True
        error = {"error": {"message": str(exc), "type": "internal_server_error"}}
        yield f"data: {json.dumps(error)}\n\n"
    finally:
        if not finished:  # the client went away (or the server stops): free the engine's work
            state.engine.abort(job.request_id)
    yield "data: [DONE]\n\n"
