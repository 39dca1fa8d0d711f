"""`POST /v1/completions` and `POST /v1/chat/completions`: one request, answered or streamed.

Both run the same way: each prompt is checked and tokenized on the tokenizer's
worker thread (tokenizer_worker.py), then goes to the engine thread as token ids
with DELTA outputs (pieces of text that never split a UTF-8 character and add
up to the final text exactly), all onto one asyncio queue; the handler reads
them and either joins them (one JSON answer) or sends each as a Server-Sent
Event. The first output of every prompt is awaited before a stream starts, so
a request the engine refuses is still a plain 400. A client that goes away
aborts its request: while its prompts are tokenized or wait for their first
step (admission.until_disconnected), while it is answered (`_watch`), or while
it streams (the stream's generator is closed). A request the engine fails
alone (its output carries the error) is a 500, or an error event in a stream
already started. Choice `i * n + j` is prompt i's completion j (a batch of
prompts, each with `n` completions). Response bodies are built in responses.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvserve import request_limits
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.serve import fields, protocol, structured, tools
from kvserve.serve.admission import request_priority, until_disconnected
from kvserve.serve.engine_thread import RequestRefused, ServerStopping, Submission
from kvserve.serve.errors import APIError, error_body, refusal
from kvserve.serve.grammar_limits import check_grammar, check_tools
from kvserve.serve.reasoning import ChatReasoning, chat_reasoning
from kvserve.serve.responses import Job, Part
from kvserve.serve.state import ServerState
from kvserve.tool_calls.parser import ToolParser

DISCONNECT_POLL_SECONDS = 0.5
log = logging.getLogger("kvserve.serve")


async def completions(request: Request, state: ServerState) -> Any:
    body = protocol.parse_json(await request.body())
    ignored = _ignored(body, state, chat=False)
    state.check_model(body.get("model"))
    prompts = protocol.completion_prompts(body)
    params = protocol.sampling_params(body, chat=False, max_n=state.max_n)
    constraint = structured.structured_outputs(body)
    check_grammar(params, None if constraint is None else constraint[1], state.limits)
    request_priority(body, state.scheduling_policy)
    state.check_admission(len(prompts))
    tokens = state.tokens
    for prompt in prompts:  # every length checked before any is tokenized
        if isinstance(prompt, str):
            tokens.check_length(len(prompt), "prompt")
        else:
            _check_ids(state, prompt)

    async def tokenized_start() -> Job:  # a client that leaves meanwhile cancels it
        ids = [p if isinstance(p, list) else await tokens.encode(p) for p in prompts]
        return await _start(state, body, params, prompts, ids, chat=False, request=request)

    job = await until_disconnected(request, tokenized_start())
    return await _answer(request, state, job, fields.header(ignored))


async def chat_completions(request: Request, state: ServerState) -> Any:
    body = protocol.parse_json(await request.body())

    async def rendered_start() -> tuple[ChatPrompt, Job]:  # cancelled if the client leaves
        prompt = await chat_prompt(state, body)
        return prompt, await start_chat(state, body, prompt, request)

    prompt, job = await until_disconnected(request, rendered_start())
    return await _answer(request, state, job, fields.header(prompt.ignored))


@dataclass(slots=True)
class ChatPrompt:
    """A chat body checked and rendered: what the engine runs, and how."""

    ids: list[int]
    params: SamplingParams
    echo: str
    """What chat's echo puts first (the last message's content when it is the assistant's)."""
    ignored: list[str]
    tool_parser: ToolParser | None = None
    """Chat with tools: the answer is read for tool calls."""
    reasoning: ChatReasoning | None = None
    """Chat with --reasoning-parser: the answer is split into reasoning and content."""


async def chat_prompt(state: ServerState, body: dict[str, Any]) -> ChatPrompt:
    """The one place a chat body becomes a prompt and SamplingParams (the Responses and
    Messages APIs translate their bodies into chat bodies and come here too)."""
    ignored = _ignored(body, state, chat=True)
    state.check_model(body.get("model"))
    messages = protocol.chat_messages(body)
    context = state.max_request_tokens
    default = protocol.DEFAULT_MAX_TOKENS if context is None else context
    params = protocol.sampling_params(body, True, state.max_n, default_max_tokens=default)
    tool_request = tools.read_tools(body)
    check_tools(tool_request, state.limits)
    parser = state.tool_parser
    assert parser is not None
    constraint = structured.structured_outputs(body)
    field_name = "response_format" if constraint is None else constraint[1]
    params = tools.constrained(params, tool_request, parser)
    calls = tool_request is not None and tool_request.parses
    check_grammar(params, "tools" if calls else field_name, state.limits)
    kwargs = protocol.template_kwargs(body)
    if "reasoning_effort" in kwargs and not state.tokens.template_reads("reasoning_effort"):
        ignored = [*ignored, "reasoning_effort"]  # passed on; this template has no use for it
        state.ignored_log.note(["reasoning_effort"])
    reasoning, params = chat_reasoning(state.reasoning_parser, kwargs, params, field_name)
    request_priority(body, state.scheduling_policy)
    state.check_admission()
    offered = None if tool_request is None else tool_request.template_tools
    ids = await state.tokens.render(messages, kwargs, offered)
    if context is not None and not protocol.sets_max_tokens(body):
        if len(ids) >= context:
            raise APIError(
                f"the prompt is {len(ids)} tokens, leaving no room to answer in "
                f"{context} (max_model_len, or what the KV pool holds)",
                param="messages",
            )
        params = protocol.with_max_tokens(params, context - len(ids))
    echo = messages[-1]["content"] if messages[-1]["role"] == "assistant" else ""
    tool_parser = parser if tool_request is not None and tool_request.parses else None
    return ChatPrompt(ids, params, echo, ignored, tool_parser, reasoning)


async def start_chat(
    state: ServerState, body: dict[str, Any], prompt: ChatPrompt, request: Request | None = None
) -> Job:
    """Submit a rendered chat prompt; back once its first step is done (a refusal: a 400).
    Read the answer with `collect` (whole) or `chunks` (the stream's chunk bodies).
    `request`: its client leaving meanwhile (a grammar still compiling) aborts it."""
    ids, parser = prompt.ids, prompt.tool_parser
    return await _start(
        state, body, prompt.params, [ids], [ids], True, prompt.echo, parser, prompt.reasoning,
        request,
    )  # fmt: skip


def _check_ids(state: ServerState, ids: list[int]) -> None:
    """A token-id prompt: in the vocabulary, and shorter than max_model_len."""
    try:
        request_limits.check_token_prompt(len(ids), state.max_model_len, "prompt")
    except request_limits.LimitError as exc:
        raise refusal(exc) from None
    state.tokens.check_ids(ids, "prompt", state.vocab_size)


def _ignored(body: dict[str, Any], state: ServerState, chat: bool) -> list[str]:
    """The fields this request's answer ignores (fields.py: the rule), each logged once."""
    served = protocol.CHAT_FIELDS if chat else protocol.COMPLETION_FIELDS
    ignored = fields.ignored_fields(body, served, chat)
    state.ignored_log.note(ignored)
    return ignored


async def _start(
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
) -> Job:
    """`prompts` as given (echo shows them), `prompt_ids` what the engine runs; `chat_echo`:
    what chat's echo puts first; `tool_parser`: chat with tools, whose output is read for
    tool calls."""
    options = protocol.response_options(body, chat=chat)
    cache_salt = protocol.cache_salt(body)
    state.check_admission(len(prompts))
    job = Job(
        request_id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        chat=chat,
        model=state.served_name,
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
        submission = Submission(engine_id, ids, params, cache_salt, job.request_id, priority)
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


async def _answer(request: Request, state: ServerState, job: Job, headers: dict[str, str]) -> Any:
    """The HTTP answer: SSE chunks, or the whole body once every choice finished."""
    if job.options.stream:
        events = _events(job, state)
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    return JSONResponse(await collect(request, job, state), headers=headers)


async def _first_outputs(
    job: Job, state: ServerState, constraint: str | None = None, request: Request | None = None
) -> None:
    """Wait until every prompt has had its first step; a refusal aborts the rest, as a 400.
    `constraint`: the field the request's structured output came from (what a refusal of
    it, or a grammar that failed to compile, names). A client that leaves meanwhile (its
    grammar compiling, its prompt queued) aborts it: its compile is dropped."""
    waiting = set(job.parts)
    state.queued += len(waiting)
    watcher = None if request is None else asyncio.create_task(_watch(request, job, state))
    try:
        while waiting:
            item = await job.outputs.get()
            if isinstance(item, _ClientGone):
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


class _ClientGone(Exception):
    """Put on a request's queue when its client left: the handler stops waiting."""


class GrammarFailed(RuntimeError):
    """The request's own grammar failed it after its first token (a dead end the compile
    could not see): the client's constraint, so a 400 (an error event once streaming)."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.message)
        self.error = error


async def _watch(request: Request, job: Job, state: ServerState) -> None:
    """Poll for a disconnect while a plain (not streamed) request runs; abort it if so."""
    while True:
        await asyncio.sleep(DISCONNECT_POLL_SECONDS)
        if await request.is_disconnected():
            _abort(job, state)
            job.outputs.put_nowait(_ClientGone())
            return


def _abort(job: Job, state: ServerState) -> None:
    unfinished = [engine_id for engine_id, part in job.parts.items() if not part.finished]
    if unfinished:
        state.engine.abort_many(job.request_id, unfinished)


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


async def collect(request: Request, job: Job, state: ServerState) -> dict[str, Any]:
    """Join the deltas; the request is aborted if the client leaves while it runs."""
    watcher = asyncio.create_task(_watch(request, job, state))
    try:
        async for output in _outputs(job):
            job.add(output)
    except _ClientGone:
        raise APIError("the client disconnected", 499) from None
    except ServerStopping as exc:
        raise APIError(str(exc), 503) from None
    except GrammarFailed as exc:
        _abort(job, state)
        raise exc.error from None
    except RuntimeError as exc:  # the engine failed a prompt, or died: the others stop too
        _abort(job, state)
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
            _abort(job, state)


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
