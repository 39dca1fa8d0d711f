"""The plain data a tool-calling answer carries: calls, and a message's text and calls."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any


def new_call_id() -> str:
    """A call's id, in OpenAI's shape (`call_` and 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ToolCall:
    """One call the model made: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def as_openai(self) -> dict[str, Any]:
        """The call as a chat message's `tool_calls` entry."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(slots=True)
class ParsedOutput:
    """A completion's text read by a tool parser: the text before the calls (None when
    there is none) and the calls (empty: the whole text is content)."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(slots=True)
class ToolCallDelta:
    """A streamed piece of call `index`: its id, type and name come once, first (with
    `arguments` ""), then fragments of its arguments' JSON text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def as_openai(self) -> dict[str, Any]:
        """The piece as a chunk's `delta.tool_calls` entry."""
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
