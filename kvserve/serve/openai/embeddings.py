"""`POST /v1/embeddings`: OpenAI's embeddings over the same engine that generates.

Each input (a string, token ids, or a batch of either) is tokenized on the
tokenizer's worker thread and goes to the engine thread as one pooling request
(kvserve.pooling_params: prefill only, its final hidden states pooled by the
server's `--pooling` rule, L2-normalized); generation and embeddings share the
step and the prefix cache. `encoding_format` "float" gives lists of numbers,
"base64" the float32 little-endian bytes (what the openai client asks for and
decodes). `dimensions` is refused: no supported checkpoint was trained for
shorter (Matryoshka) embeddings, so truncating them would be a wrong answer.

Limits, all checked before any input is tokenized: at most MAX_BATCH_PROMPTS
inputs (completions' batch limit), each string no longer than any prompt of
`max_model_len` tokens can be, each token-id list shorter than `max_model_len`
and in the vocabulary. The inputs are one client request to the scheduler
(admitted round-robin with other clients' requests), and a client that leaves,
before or during the answer, aborts every input still tokenizing or running.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from kvserve.lora.request import LoRARequest
from kvserve.outputs import RequestOutput
from kvserve.pooling_params import PoolingParams
from kvserve.prompt_fields import is_token_ids
from kvserve.serve.http.admission import request_priority, until_disconnected
from kvserve.serve.http.engine_thread import RequestRefused, ServerStopping, Submission
from kvserve.serve.http.errors import APIError
from kvserve.serve.request import fields, protocol
from kvserve.serve.state import ServerState

SERVED = frozenset(
    {"model", "input", "encoding_format", "dimensions", "add_special_tokens", "priority", "user"}
)
REFUSED = {
    "truncate_prompt_tokens": "prompt truncation",
    "normalize": "a per-request normalization (embeddings are always L2-normalized)",
}
"""vLLM's embedding fields that would change the answer: a 400 naming them (null is fine)."""
ENCODINGS = ("float", "base64")


async def embeddings(request: Request, state: ServerState) -> Any:
    body = protocol.parse_json(await request.body())
    ignored = _ignored(body, state)
    lora = state.check_model(body.get("model"))
    inputs = embedding_inputs(body.get("input"))
    encoding = body.get("encoding_format") or "float"
    if encoding not in ENCODINGS:
        raise APIError(f"encoding_format must be one of {ENCODINGS}", param="encoding_format")
    if body.get("dimensions") is not None:
        raise APIError(
            "dimensions is not supported: this model's embeddings have one size",
            param="dimensions",
        )
    special = body.get("add_special_tokens", True)
    if not isinstance(special, bool):
        raise APIError("add_special_tokens must be true or false", param="add_special_tokens")
    priority = request_priority(body, state.scheduling_policy)
    _check_inputs(state, inputs)
    state.check_admission(len(inputs))
    ids, outputs = await until_disconnected(request, _embed(state, inputs, special, priority, lora))
    data = [
        {"object": "embedding", "index": i, "embedding": _encoded(out.embedding, encoding)}
        for i, out in enumerate(outputs)
    ]
    prompt_tokens = sum(len(p) for p in ids)
    answer = {
        "object": "list",
        "data": data,
        "model": state.answer_name(body.get("model")),
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
    return JSONResponse(answer, headers=fields.header(ignored))


def embedding_inputs(value: Any) -> list[str | list[int]]:
    """OpenAI's `input`: a string, token ids, or a non-empty list of strings or of token-id
    lists; a 400 naming `input` (and the item) for anything else."""
    if isinstance(value, str) or is_token_ids(value):
        items = [value]
    elif isinstance(value, list) and len(value) > protocol.MAX_BATCH_PROMPTS:
        raise APIError(
            f"input has {len(value)} items; at most {protocol.MAX_BATCH_PROMPTS} per request",
            param="input",
        )
    elif isinstance(value, list) and value and all(isinstance(v, str | list) for v in value):
        items = value
    else:
        raise APIError(
            "input must be a non-empty string, a list of token ids, or a non-empty list of "
            "strings or of token-id lists",
            param="input",
        )
    for i, item in enumerate(items):
        if not (isinstance(item, str) and item) and not is_token_ids(item):
            where = "input" if len(items) == 1 else f"input[{i}]"
            message = f"{where} must be a non-empty string or list of token ids"
            raise APIError(message, param="input")
    return items


def _ignored(body: dict[str, Any], state: ServerState) -> list[str]:
    for name, what in REFUSED.items():
        if body.get(name) is not None:
            raise APIError(f"{name} is not supported: kvserve does not do {what}", param=name)
    ignored = [name for name in body if name not in SERVED and name not in REFUSED]
    state.ignored_log.note(ignored)
    return ignored


def _check_inputs(state: ServerState, inputs: list[str | list[int]]) -> None:
    """Every input's length (and a token-id input's ids), before any is tokenized."""
    tokens = state.tokens
    limit = state.max_model_len
    for i, item in enumerate(inputs):
        where = "input" if len(inputs) == 1 else f"input[{i}]"
        if isinstance(item, str):
            tokens.check_length(len(item), "input")
        elif limit is not None and len(item) >= limit:
            message = f"{where} is {len(item)} tokens; max_model_len is {limit}"
            raise APIError(message, param="input")
        else:
            tokens.check_ids(item, "input", state.vocab_size)


async def _embed(
    state: ServerState,
    inputs: list[str | list[int]],
    special: bool,
    priority: int,
    lora: LoRARequest | None,
) -> tuple[list[list[int]], list[RequestOutput]]:
    """Tokenize, then pool (with the adapter `model` named, if any): the work a client that
    leaves cancels (until_disconnected)."""
    ids = await _token_ids(state, inputs, special)
    return ids, await _pool(state, ids, priority, lora)


async def _token_ids(
    state: ServerState, inputs: list[str | list[int]], special: bool
) -> list[list[int]]:
    """Every input's ids (checked again once tokenized: a string's token count)."""
    tokens = state.tokens
    ids = [i if isinstance(i, list) else await tokens.encode(i, special) for i in inputs]
    limit = state.max_model_len
    for i, prompt in enumerate(ids):
        where = "input" if len(ids) == 1 else f"input[{i}]"
        if not prompt:
            raise APIError(f"{where} is empty after tokenization", param="input")
        if limit is not None and len(prompt) >= limit:
            raise APIError(
                f"{where} is {len(prompt)} tokens; max_model_len is {limit}", param="input"
            )
    return ids


async def _pool(
    state: ServerState, ids: list[list[int]], priority: int, lora: LoRARequest | None
) -> list[RequestOutput]:
    """One pooling request per input on the engine thread, all one client request to the
    scheduler; their outputs in input order. A refusal is a 400, an engine failure a 500;
    leaving early (this coroutine cancelled) aborts what still runs."""
    queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
    base = f"embd-{uuid.uuid4().hex}"
    params = PoolingParams(state.pooling)
    order = {f"{base}-{i}": i for i in range(len(ids))}
    for engine_id, i in order.items():
        submission = Submission(
            engine_id, ids[i], params, client_id=base, priority=priority, lora=lora
        )
        state.engine.submit(submission, queue)
    done: dict[str, RequestOutput] = {}
    state.queued += len(order)
    try:
        while len(done) < len(order):
            item = await queue.get()
            if isinstance(item, RequestRefused):
                index = order[item.request_id]
                where = "" if len(order) == 1 else f"input[{index}]: "
                raise APIError(f"{where}{item}", param="input")
            if isinstance(item, ServerStopping):
                raise APIError(str(item), 503)
            if isinstance(item, BaseException):
                raise APIError(str(item), 500)
            if item.error is not None or item.embedding is None:
                raise APIError(f"the engine failed this request: {item.error}", 500)
            done[item.request_id] = item
    finally:
        state.queued -= len(order)
        unfinished = [engine_id for engine_id in order if engine_id not in done]
        if unfinished:
            state.engine.abort_many(base, unfinished)
    return [done[engine_id] for engine_id in order]


def _encoded(vector: list[float] | None, encoding: str) -> list[float] | str:
    assert vector is not None
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
