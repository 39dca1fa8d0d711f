"""A generation request submitted to the engine thread, and back once its first step is done.

`start` (and chat's `start_chat`) makes the request's Job (generation/job.py), hands
each prompt to the engine thread as token ids with DELTA outputs (pieces of text
that never split a UTF-8 character and add up to the final text exactly), all onto
one asyncio queue, and waits for every prompt's first output before any answer
starts: a request the engine refuses is still a plain 400 (naming the field its
constraint came from). A client that leaves meanwhile aborts it (`watch` polls for
the disconnect while a plain request runs; stream.py reads the rest). Choice
`i * n + j` is prompt i's completion j (a batch of prompts, each with `n`
completions).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from fastapi import Request

from kvserve.lora.request import LoRARequest
from kvserve.sampling_params import SamplingParams
from kvserve.serve.generation.job import Job, Part
from kvserve.serve.generation.prompts import ChatPrompt
from kvserve.serve.http.admission import request_priority
from kvserve.serve.http.engine_thread import RequestRefused, ServerStopping, Submission
from kvserve.serve.http.errors import APIError
from kvserve.serve.request import protocol, structured, tools
from kvserve.serve.request.reasoning import ChatReasoning
from kvserve.serve.state import ServerState
from kvserve.tool_calls.parser import ToolParser

DISCONNECT_POLL_SECONDS = 0.5
log = logging.getLogger("kvserve.serve")


async def start_chat(
    state: ServerState, body: dict[str, Any], prompt: ChatPrompt, request: Request | None = None
) -> Job:
    """Submit a rendered chat prompt; back once its first step is done (a refusal: a 400).
    Read the answer with stream.py's `collect` (whole) or `chunks` (the chunk bodies).
    `request`: its client leaving meanwhile (a grammar still compiling) aborts it."""
    ids, parser = prompt.ids, prompt.tool_parser
    return await start(
        state, body, prompt.params, [ids], [ids], True, prompt.echo, parser, prompt.reasoning,
        request, prompt.lora,
    )  # fmt: skip


async def start(
    state: ServerState,
    body: dict[str, Any],
    params: SamplingParams,
    prompts: list[str | list[int]],
    prompt_ids: list[list[int]],
    chat: bool,
    chat_echo: str = "",
    tool_parser: ToolParser | None = None,
    reasoning: ChatReasoning | None = None,
    request: Request | None = None,
    lora: LoRARequest | None = None,
) -> Job:
    """`prompts` as given (echo shows them), `prompt_ids` what the engine runs; `chat_echo`:
    what chat's echo puts first; `tool_parser`: chat with tools, whose output is read for
    tool calls; `lora`: the adapter `model` named (state.check_model), which every prompt
    runs with."""
    options = protocol.response_options(body, chat=chat)
    cache_salt = protocol.cache_salt(body)
    state.check_admission(len(prompts))
    job = Job(
        request_id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        chat=chat,
        model=state.answer_name(body.get("model")),
        created=int(time.time()),
        n=params.n,
        options=options,
        outputs=asyncio.Queue(),
        tool_parser=tool_parser,
        reasoning=reasoning,
    )
    if state.log_requests:
        log.info("request %s: prompts=%r params=%r", job.request_id, prompts, params)
    priority = request_priority(body, state.scheduling_policy)
    for i, ids in enumerate(prompt_ids):  # one client request: admitted round-robin with others
        engine_id = job.request_id if len(prompts) == 1 else f"{job.request_id}-{i}"
        job.parts[engine_id] = Part(index=i, prompt_tokens=len(ids))
        submission = Submission(engine_id, ids, params, cache_salt, job.request_id, priority, lora)
        state.engine.submit(submission, job.outputs)
    constraint = structured.structured_outputs(body)
    source = "tools" if tool_parser is not None else None
    job.constraint = source or (None if constraint is None else constraint[1])
    await _first_outputs(job, state, job.constraint, request)
    if options.echo and chat:
        for part in job.parts.values():
            part.echo = chat_echo
    elif options.echo:
        await _echo_texts(job, state, prompts)
    return job


async def _first_outputs(
    job: Job, state: ServerState, constraint: str | None = None, request: Request | None = None
) -> None:
    """Wait until every prompt has had its first step; a refusal aborts the rest, as a 400.
    `constraint`: the field the request's structured output came from (what a refusal of
    it, or a grammar that failed to compile, names). A client that leaves meanwhile (its
    grammar compiling, its prompt queued) aborts it: its compile is dropped."""
    waiting = set(job.parts)
    state.queued += len(waiting)
    watcher = None if request is None else asyncio.create_task(watch(request, job, state))
    try:
        while waiting:
            item = await job.outputs.get()
            if isinstance(item, ClientGone):
                raise APIError("the client disconnected", 499)
            if isinstance(item, RequestRefused):
                # names the request and counts, never the prompt's text
                message = tools.as_sent(str(item)) if constraint == "tools" else str(item)
                if len(job.parts) > 1:
                    message = f"prompt {job.parts[item.request_id].index}: {message}"
                param = structured.engine_param(str(item), constraint)
                raise APIError(message, param=param or protocol.refused_field(message))
            if isinstance(item, ServerStopping):
                raise APIError(str(item), 503)
            if isinstance(item, BaseException):
                raise APIError(str(item), 500)
            if item.error is not None:
                failed = structured.compile_failure(item.error, constraint)
                if failed is not None:
                    raise failed
                raise APIError(f"the engine failed this request: {item.error}", 500)
            waiting.discard(item.request_id)
            job.early.append(item)
    except BaseException:
        state.engine.abort_many(job.request_id, list(job.parts))
        raise
    finally:
        if watcher is not None:
            watcher.cancel()
        state.queued -= len(job.parts)


async def _echo_texts(job: Job, state: ServerState, prompts: list[str | list[int]]) -> None:
    """`echo`: each choice starts with its prompt's text (decoded when given as token ids)."""
    for part, prompt in zip(job.parts.values(), prompts, strict=True):
        if isinstance(prompt, str):
            part.echo = prompt
        elif state.tokens.tokenizer is None:
            raise APIError("echo needs a tokenizer to decode token-id prompts", param="echo")
        else:
            part.echo = await state.tokens.decode(prompt)


class ClientGone(Exception):
    """Put on a request's queue when its client left: the handler stops waiting."""


async def watch(request: Request, job: Job, state: ServerState) -> None:
    """Poll for a disconnect while a plain (not streamed) request runs; abort it if so."""
    while True:
        await asyncio.sleep(DISCONNECT_POLL_SECONDS)
        if await request.is_disconnected():
            abort(job, state)
            job.outputs.put_nowait(ClientGone())
            return


def abort(job: Job, state: ServerState) -> None:
    unfinished = [engine_id for engine_id, part in job.parts.items() if not part.finished]
    if unfinished:
        state.engine.abort_many(job.request_id, unfinished)
