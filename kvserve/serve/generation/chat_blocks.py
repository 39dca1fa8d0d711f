"""A chat answer as content blocks: the text, then each tool call, whole or streamed.

The Responses and Messages APIs run every request through the chat path
(generation/) and get its answer back in chat's words: one body with
`message.content` and `message.tool_calls`, or a stream of chunk bodies
whose deltas carry text and tool-call fragments (index, id and name first,
then argument pieces). Both APIs answer in blocks instead (output items;
content blocks), opened, grown and closed in order. This reader is the one
place that turns chat's shape into blocks, so the two APIs only render them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from kvserve.serve.http.errors import APIError


@dataclass(slots=True)
class Block:
    """One block of the answer: text, or one tool call (its arguments as `text`)."""

    kind: Literal["text", "tool"]
    index: int
    """Its place in the answer (0, 1, ...)."""
    text: str = ""
    call_id: str = ""
    name: str = ""


@dataclass(slots=True)
class Piece:
    """What a stream says about a block: it starts, it grows by `delta`, it stops."""

    what: Literal["start", "delta", "stop"]
    block: Block
    delta: str = ""


@dataclass(slots=True)
class ChatAnswer:
    """Chat's answer as blocks, with its finish reason and usage."""

    blocks: list[Block] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    """The stop string (or token id) that ended the answer, if one did."""
    usage: dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return "".join(b.text for b in self.blocks if b.kind == "text")

    def assistant_message(self) -> dict[str, Any]:
        """The answer as the chat message a next turn sends back (what the template renders)."""
        calls = [
            {
                "id": b.call_id,
                "type": "function",
                "function": {"name": b.name, "arguments": b.text},
            }
            for b in self.blocks
            if b.kind == "tool"
        ]
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        if calls:
            message["tool_calls"] = calls
        return message

    def prompt_tokens(self) -> tuple[int, int]:
        """(prompt tokens, of which cached)."""
        details = self.usage.get("prompt_tokens_details") or {}
        return self.usage.get("prompt_tokens", 0), details.get("cached_tokens", 0)


def whole_answer(body: dict[str, Any]) -> ChatAnswer:
    """A chat completion body (one choice) as blocks."""
    choice = body["choices"][0]
    message = choice["message"]
    answer = ChatAnswer(
        finish_reason=choice.get("finish_reason"),
        stop_reason=choice.get("stop_reason"),
        usage=body.get("usage") or {},
    )
    if message.get("content"):
        answer.blocks.append(Block("text", 0, message["content"]))
    for call in message.get("tool_calls") or []:
        function = call["function"]
        index = len(answer.blocks)
        answer.blocks.append(
            Block("tool", index, function.get("arguments") or "", call["id"], function["name"])
        )
    return answer


@dataclass(slots=True)
class StreamReader:
    """Chat chunk bodies in, block pieces out; `answer` holds what was read so far."""

    answer: ChatAnswer = field(default_factory=ChatAnswer)
    _open: Block | None = None
    _tools: dict[int, Block] = field(default_factory=dict)
    """Chat's tool-call index -> its block."""

    def feed(self, chunk: dict[str, Any]) -> list[Piece]:
        if chunk.get("usage"):
            self.answer.usage = chunk["usage"]
        pieces: list[Piece] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                pieces += self._grow(None, delta["content"])
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                pieces += self._grow(call, function.get("arguments") or "")
            if choice.get("finish_reason") is not None:
                self.answer.finish_reason = choice["finish_reason"]
                self.answer.stop_reason = choice.get("stop_reason")
                pieces += self.close()
        return pieces

    def close(self) -> list[Piece]:
        """Stop the open block (the answer ended, or the stream failed)."""
        if self._open is None:
            return []
        block, self._open = self._open, None
        return [Piece("stop", block)]

    def _grow(self, call: dict[str, Any] | None, text: str) -> list[Piece]:
        """Text (`call` None) or a tool call's fragment: its block, opened if new."""
        pieces: list[Piece] = []
        block = self._open
        if call is not None:
            index = call.get("index", 0)
            block = self._tools.get(index)
            if block is None:
                pieces += self.close()
                function = call.get("function") or {}
                if not call.get("id") or not function.get("name"):
                    raise APIError("a streamed tool call came without its id and name", 500)
                block = Block("tool", len(self.answer.blocks), "", call["id"], function["name"])
                self._tools[index] = block
                self._start(block, pieces)
        elif block is None or block.kind != "text":
            pieces += self.close()
            block = Block("text", len(self.answer.blocks))
            self._start(block, pieces)
        if text:
            block.text += text
            pieces.append(Piece("delta", block, text))
        return pieces

    def _start(self, block: Block, pieces: list[Piece]) -> None:
        self.answer.blocks.append(block)
        self._open = block
        pieces.append(Piece("start", block))
