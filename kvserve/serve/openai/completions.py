"""`POST /v1/completions`: a batch of prompts (text or token ids), answered or streamed.

Read top-down: the body is parsed and checked (request/), every prompt's length
checked before any is tokenized, the prompts tokenized on the tokenizer's worker
thread and submitted (generation/submit.py), then answered whole or streamed
(generation/stream.py). A client that leaves while its prompts are tokenized or
wait for their first step cancels them (http/admission.until_disconnected).
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from kvserve import request_limits
from kvserve.serve.generation.job import Job
from kvserve.serve.generation.prompts import note_ignored
from kvserve.serve.generation.stream import answer
from kvserve.serve.generation.submit import start
from kvserve.serve.http.admission import request_priority, until_disconnected
from kvserve.serve.http.errors import refusal
from kvserve.serve.request import fields, protocol, structured
from kvserve.serve.request.grammar_limits import check_grammar
from kvserve.serve.state import ServerState


async def completions(request: Request, state: ServerState) -> Any:
    body = protocol.parse_json(await request.body())
    ignored = note_ignored(body, state, chat=False)
    lora = state.check_model(body.get("model"))
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
        return await start(
            state, body, params, prompts, ids, chat=False, request=request, lora=lora
        )

    job = await until_disconnected(request, tokenized_start())
    return await answer(request, state, job, fields.header(ignored))


def _check_ids(state: ServerState, ids: list[int]) -> None:
    """A token-id prompt: in the vocabulary, and shorter than max_model_len."""
    try:
        request_limits.check_token_prompt(len(ids), state.max_model_len, "prompt")
    except request_limits.LimitError as exc:
        raise refusal(exc) from None
    state.tokens.check_ids(ids, "prompt", state.vocab_size)
