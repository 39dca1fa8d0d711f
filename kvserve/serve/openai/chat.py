"""`POST /v1/chat/completions`: one conversation, answered or streamed.

Read top-down: the body becomes a rendered prompt and its SamplingParams
(generation/prompts.chat_prompt, the one place every chat-shaped API comes
through), is submitted (generation/submit.start_chat), then answered whole or
streamed (generation/stream.answer). A client that leaves while it renders or
waits for its first step cancels it.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from kvserve.serve.generation.job import Job
from kvserve.serve.generation.prompts import ChatPrompt, chat_prompt
from kvserve.serve.generation.stream import answer
from kvserve.serve.generation.submit import start_chat
from kvserve.serve.http.admission import until_disconnected
from kvserve.serve.request import fields, protocol
from kvserve.serve.state import ServerState


async def chat_completions(request: Request, state: ServerState) -> Any:
    body = protocol.parse_json(await request.body())

    async def rendered_start() -> tuple[ChatPrompt, Job]:  # cancelled if the client leaves
        prompt = await chat_prompt(state, body)
        return prompt, await start_chat(state, body, prompt, request)

    prompt, job = await until_disconnected(request, rendered_start())
    return await answer(request, state, job, fields.header(prompt.ignored))
