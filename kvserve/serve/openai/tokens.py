"""`POST /tokenize` and `POST /detokenize`: a prompt's token ids, and token ids back to text.

vLLM's utility routes: /tokenize renders a conversation through the chat template
exactly as chat runs it (its `tools` checked and offered the same way), or
encodes a plain prompt; /detokenize decodes token ids. Both run on the
tokenizer's worker thread (http/tokenizer_worker.py), never on the event loop,
and a client that leaves drops its work.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from kvserve.serve.http.admission import until_disconnected
from kvserve.serve.http.errors import APIError
from kvserve.serve.request import protocol, tools
from kvserve.serve.request.grammar_limits import check_tools
from kvserve.serve.state import ServerState


async def tokenize(request: Request, state: ServerState) -> dict[str, Any]:
    return await until_disconnected(request, _tokenize(request, state))  # leaves: dropped


async def detokenize(request: Request, state: ServerState) -> dict[str, Any]:
    body = protocol.parse_json(await request.body())
    protocol.check_fields(body, protocol.DETOKENIZE_FIELDS)
    state.check_model(body.get("model"))
    tokens = body.get("tokens")
    if isinstance(tokens, list):
        state.tokens.check_decode_length(len(tokens), "tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise APIError("tokens must be a list of token ids", param="tokens")
    state.tokens.checked_tokenizer()
    state.tokens.check_ids(tokens, "tokens")
    return {"prompt": await until_disconnected(request, state.tokens.decode(tokens))}


async def _tokenize(request: Request, state: ServerState) -> dict[str, Any]:
    """A prompt's token ids, or a conversation's through the chat template (as chat runs it,
    its `tools` included)."""
    body = protocol.parse_json(await request.body())
    protocol.check_fields(body, protocol.TOKENIZE_FIELDS)
    state.check_model(body.get("model"))
    worker = state.tokens
    worker.checked_tokenizer()
    if "messages" in body:
        offered = tools.read_tools(body)
        check_tools(offered, state.limits)  # as chat refuses them, before rendering
        template_tools = None if offered is None else offered.template_tools
        tokens = await worker.render(protocol.chat_messages(body), None, template_tools)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise APIError("prompt must be a string", param="prompt")
        special = body.get("add_special_tokens", True)
        if not isinstance(special, bool):
            raise APIError("add_special_tokens must be true or false", param="add_special_tokens")
        worker.check_length(len(prompt), "prompt")
        tokens = await worker.encode(prompt, add_special_tokens=special)
    return {"tokens": tokens, "count": len(tokens), "max_model_len": state.max_model_len}
