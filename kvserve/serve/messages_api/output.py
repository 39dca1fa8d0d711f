"""Chat's answer (generation/chat_blocks.py) as an Anthropic Message, whole or as its stream events.

Text is a `text` block, each tool call a `tool_use` block (its id chat's
tool-call id, its input the arguments parsed). A stream sends
`message_start`, per block `content_block_start`, its deltas (`text_delta`,
`input_json_delta`) and `content_block_stop`, then `message_delta` with the
stop reason and usage, and `message_stop`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvserve.serve.generation.chat_blocks import Block, ChatAnswer, Piece
from kvserve.serve.http.errors import APIError

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(message: str, status: int) -> dict[str, Any]:
    """Anthropic's error body (the type from the status; any other status: api_error)."""
    kind = ERROR_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def stop_reason(answer: ChatAnswer, stops: list[str]) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) in Anthropic's words, from chat's finish reason."""
    finish = answer.finish_reason
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if finish == "stop" and isinstance(answer.stop_reason, str) and answer.stop_reason in stops:
        return "stop_sequence", answer.stop_reason
    return ("end_turn", None) if finish == "stop" else (finish, None)


def usage(chat: dict[str, Any], generated: bool = True) -> dict[str, Any]:
    """input_tokens are the prompt's tokens not read from the cache, as Anthropic counts."""
    prompt = chat.get("prompt_tokens", 0)
    cached = (chat.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": chat.get("completion_tokens", 0) if generated else 0,
    }


def block(b: Block, done: bool = True) -> dict[str, Any]:
    if b.kind == "text":
        return {"type": "text", "text": b.text if done else ""}
    return {"type": "tool_use", "id": b.call_id, "name": b.name, "input": _input(b) if done else {}}


def _input(b: Block) -> dict[str, Any]:
    try:
        value = json.loads(b.text or "{}")
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise APIError(f"the model's call of {b.name!r} has arguments that are not an object", 500)
    return value


@dataclass(slots=True)
class MessageShape:
    id: str
    model: str
    stops: list[str]

    def body(self, answer: ChatAnswer | None) -> dict[str, Any]:
        """The Message; `answer` None: message_start's (no content yet)."""
        reason, sequence = (None, None) if answer is None else stop_reason(answer, self.stops)
        chat_usage = {} if answer is None else answer.usage
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [] if answer is None else [block(b) for b in answer.blocks],
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage(chat_usage),
        }


def event(kind: str, body: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **body}, ensure_ascii=False)}\n\n"


def start_event(shape: MessageShape, chat_usage: dict[str, Any]) -> str:
    message = shape.body(None)
    message["usage"] = usage(chat_usage, generated=False)
    return event("message_start", {"message": message})


def piece_event(piece: Piece) -> str:
    b = piece.block
    if piece.what == "start":
        return event("content_block_start", {"index": b.index, "content_block": block(b, False)})
    if piece.what == "stop":
        return event("content_block_stop", {"index": b.index})
    if b.kind == "text":
        delta = {"type": "text_delta", "text": piece.delta}
    else:
        delta = {"type": "input_json_delta", "partial_json": piece.delta}
    return event("content_block_delta", {"index": b.index, "delta": delta})


def end_events(shape: MessageShape, answer: ChatAnswer) -> list[str]:
    reason, sequence = stop_reason(answer, shape.stops)
    delta = {"stop_reason": reason, "stop_sequence": sequence}
    return [
        event("message_delta", {"delta": delta, "usage": usage(answer.usage)}),
        event("message_stop", {}),
    ]
