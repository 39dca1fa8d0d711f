"""Chat's answer (generation/chat_blocks.py) as a Response object, whole or as typed events.

Text is an output item of type `message` (one `output_text` part), each tool
call an item of type `function_call` (`call_id` is chat's tool-call id). A
stream sends `response.created` and `response.in_progress`, then per item
`response.output_item.added`, its deltas (`response.output_text.delta`, or
`response.function_call_arguments.delta`), its `.done` events and
`response.output_item.done`, and last `response.completed` (or
`response.incomplete` when max_output_tokens cut it), every event numbered by
`sequence_number`.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvserve.serve.generation.chat_blocks import Block, ChatAnswer, Piece


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(slots=True)
class ResponseShape:
    """What every view of one response shares: its id, and the request's fields it echoes."""

    id: str
    created_at: int
    model: str
    request: dict[str, Any]
    item_ids: dict[int, str] = field(default_factory=dict)
    """Block index -> its output item's id (the same in the events and the final object)."""

    def item_id(self, block: Block) -> str:
        if block.index not in self.item_ids:
            self.item_ids[block.index] = new_id("msg" if block.kind == "text" else "fc")
        return self.item_ids[block.index]

    def item(self, block: Block, done: bool) -> dict[str, Any]:
        status = "completed" if done else "in_progress"
        if block.kind == "tool":
            return {
                "type": "function_call",
                "id": self.item_id(block),
                "call_id": block.call_id,
                "name": block.name,
                "arguments": block.text,
                "status": status,
            }
        content = [text_part(block.text)] if done else []
        return {
            "type": "message",
            "id": self.item_id(block),
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def items(self, answer: ChatAnswer, status: str) -> list[dict[str, Any]]:
        """The output items; the last one `incomplete` when max_output_tokens cut it."""
        items = [self.item(b, True) for b in answer.blocks]
        if items and status == "incomplete":
            items[-1]["status"] = "incomplete"
        return items

    def body(self, answer: ChatAnswer | None) -> dict[str, Any]:
        """The Response object; `answer` None: just created (in progress, no output yet)."""
        request = self.request
        status, incomplete = "in_progress", None
        if answer is not None:
            status = "completed"
            if answer.finish_reason == "length":
                status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "model": self.model,
            "output": [] if answer is None else self.items(answer, status),
            "usage": None if answer is None else usage(answer.usage),
            "instructions": request.get("instructions"),
            "max_output_tokens": request.get("max_output_tokens"),
            "temperature": request.get("temperature", 1.0),
            "top_p": request.get("top_p", 1.0),
            "tools": request.get("tools") or [],
            "tool_choice": request.get("tool_choice") or "auto",
            "parallel_tool_calls": request.get("parallel_tool_calls") is not False,
            "previous_response_id": request.get("previous_response_id"),
            "store": request.get("store", True) is not False,
            "text": request.get("text") or {"format": {"type": "text"}},
            "metadata": request.get("metadata") or {},
            "truncation": "disabled",
            "reasoning": None,
            "user": request.get("user"),
        }


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def usage(chat: dict[str, Any]) -> dict[str, Any]:
    """Chat's usage in the Responses API's words."""
    prompt = chat.get("prompt_tokens", 0)
    generated = chat.get("completion_tokens", 0)
    cached = (chat.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": generated,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + generated,
    }


@dataclass(slots=True)
class EventWriter:
    """OpenAI's typed SSE events for one response, numbered in order."""

    shape: ResponseShape
    sequence: int = 0

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def opening(self) -> list[str]:
        body = self.shape.body(None)
        return [
            self.event("response.created", response=body),
            self.event("response.in_progress", response=body),
        ]

    def piece(self, piece: Piece) -> list[str]:
        block = piece.block
        where = {"item_id": self.shape.item_id(block), "output_index": block.index}
        if piece.what == "start":
            events = [
                self.event(
                    "response.output_item.added",
                    output_index=block.index,
                    item=self.shape.item(block, False),
                )
            ]
            if block.kind == "text":
                part = text_part("")
                events.append(
                    self.event("response.content_part.added", **where, content_index=0, part=part)
                )
            return events
        if piece.what == "delta" and block.kind == "text":
            return [
                self.event(
                    "response.output_text.delta",
                    **where,
                    content_index=0,
                    delta=piece.delta,
                    logprobs=[],
                )
            ]
        if piece.what == "delta":
            kind = "response.function_call_arguments.delta"
            return [self.event(kind, **where, delta=piece.delta)]
        if block.kind == "text":
            events = [
                self.event(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=block.text,
                    logprobs=[],
                ),
                self.event(
                    "response.content_part.done",
                    **where,
                    content_index=0,
                    part=text_part(block.text),
                ),
            ]
        else:
            events = [
                self.event(
                    "response.function_call_arguments.done",
                    **where,
                    name=block.name,
                    arguments=block.text,
                )
            ]
        item = self.shape.item(block, True)
        events.append(self.event("response.output_item.done", output_index=block.index, item=item))
        return events

    def closing(self, answer: ChatAnswer) -> tuple[str, dict[str, Any]]:
        """The last event, and the final Response object it carries."""
        body = self.shape.body(answer)
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        return self.event(kind, response=body), body

    def error(self, message: str, code: str = "server_error") -> str:
        return self.event("error", code=code, message=message, param=None)
