"""An Anthropic Messages body -> the chat-completions body the chat path runs.

`system` becomes a system message first; a user turn's `tool_result` blocks
become `tool` messages (before the turn's text, where Anthropic puts them);
an assistant turn's `tool_use` blocks become its tool calls (arguments: the
input as JSON); `max_tokens`, `stop_sequences`, `temperature`, `top_p`,
`top_k` map by name; tools (`input_schema`) become function tools and
`tool_choice` auto / any / tool / none becomes "auto" / "required" / the named
function / "none", and its `disable_parallel_tool_use` chat's
`parallel_tool_calls: false`. Rendering and tokenizing are the chat path's
(generation/prompts.chat_prompt), as for every other API.
"""

from __future__ import annotations

import json
from typing import Any

from kvserve.serve.http.errors import APIError
from kvserve.serve.request.fields import Unsupported, strict_fields
from kvserve.serve.request.protocol import flag

SERVED = frozenset(
    {
        "model",
        "messages",
        "system",
        "max_tokens",
        "stop_sequences",
        "temperature",
        "top_p",
        "top_k",
        "tools",
        "tool_choice",
        "stream",
    }
)
COUNT_SERVED = frozenset({"model", "messages", "system", "tools", "tool_choice"})
"""/v1/messages/count_tokens: what shapes the prompt."""
IGNORED = frozenset(
    {
        "metadata",
        "service_tier",
        "cache_control",  # the prefix cache is automatic
        "inference_geo",
        "speed",
        "diagnostics",
        "user_profile_id",
        "workspace_id",
    }
)
"""Documented fields that change nothing in the answer: accepted, named in the header."""
REFUSED: dict[str, Unsupported] = {
    "thinking": Unsupported("extended thinking", ({"type": "disabled"},)),
    "container": Unsupported("containers"),
    "mcp_servers": Unsupported("MCP servers", ([],)),
    "context_management": Unsupported("context management"),
    "output_config": Unsupported("output_config", ({},)),
}
"""Fields that would change the answer: a 400 naming them unless their value is neutral."""


def translate(body: dict[str, Any], count_only: bool = False) -> tuple[dict[str, Any], list[str]]:
    """(the chat body, the ignored fields); `count_only`: /count_tokens (no max_tokens)."""
    served = COUNT_SERVED if count_only else SERVED
    ignored = strict_fields(body, served, IGNORED, REFUSED)
    messages = [*_system(body.get("system")), *chat_messages(body.get("messages"))]
    chat: dict[str, Any] = {"messages": messages}
    if not count_only:
        if body.get("max_tokens") is None:
            raise APIError("max_tokens: field required", param="max_tokens")
        chat["max_tokens"] = body["max_tokens"]
    for name in ("model", "temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            chat[name] = body[name]
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise APIError("stop_sequences must be a list of strings", param="stop_sequences")
        chat["stop"] = stops
    if body.get("tools"):
        chat["tools"] = chat_tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = chat_tool_choice(body["tool_choice"])
        if _one_call_only(body["tool_choice"]):
            chat["parallel_tool_calls"] = False
    if flag(body, "stream"):
        # usage on every chunk: message_start carries the prompt's tokens
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return chat, ignored


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, list):
        system = _texts(system, "system")
    if not isinstance(system, str):
        raise APIError("system must be a string or a list of text blocks", param="system")
    return [{"role": "system", "content": system}]


def _texts(blocks: list[Any], where: str) -> str:
    texts = []
    for block in blocks:
        if not isinstance(block, dict) or block.get("type") != "text":
            raise APIError(f"{where}: only text blocks are served here", param=where)
        if not isinstance(block.get("text"), str):
            raise APIError(f"{where}: a text block needs a string 'text'", param=where)
        texts.append(block["text"])
    return "".join(texts)


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """Anthropic's turns as chat messages (one turn may give several)."""
    if not isinstance(messages, list) or not messages:
        raise APIError("messages must be a non-empty list", param="messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise APIError(f"messages.{i}.role must be 'user' or 'assistant'", param="messages")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": message["role"], "content": content})
        elif isinstance(content, list):
            out += _turn(message["role"], content, i)
        else:
            raise APIError(
                f"messages.{i}.content must be a string or a list of blocks", param="messages"
            )
    return out


def _turn(role: str, blocks: list[Any], i: int) -> list[dict[str, Any]]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        where = f"messages.{i}.content.{j}"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise APIError(f"{where}: tool_use needs a string id and name", param="messages")
            if not isinstance(block.get("input"), dict):
                raise APIError(f"{where}: tool_use input must be an object", param="messages")
            arguments = json.dumps(block["input"], ensure_ascii=False)
            function = {"name": block["name"], "arguments": arguments}
            calls.append({"id": block["id"], "type": "function", "function": function})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise APIError(f"{where}: tool_result needs a tool_use_id", param="messages")
            content = block.get("content", "")
            if isinstance(content, list):
                content = _texts(content, "messages")
            if not isinstance(content, str):
                raise APIError(f"{where}: tool_result content must be text", param="messages")
            call_id = block["tool_use_id"]
            results.append({"role": "tool", "tool_call_id": call_id, "content": content})
        else:
            raise APIError(
                f"{where}: {str(kind)[:40]!r} blocks are not served in a {role} turn "
                "(text, tool_use from the assistant, tool_result from the user are)",
                param="messages",
            )
    if role == "assistant":
        message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if calls:
            message["tool_calls"] = calls
        return [message]
    text = [{"role": "user", "content": "".join(texts)}] if texts or not results else []
    return [*results, *text]


def chat_tools(tools: Any) -> list[dict[str, Any]]:
    """Anthropic's client tools (name, description, input_schema) as chat's function tools."""
    if not isinstance(tools, list):
        raise APIError("tools must be a list", param="tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise APIError(
                f"tools.{i}: only client tools are served, not {str(kind)[:40]!r}", param="tools"
            )
        if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
            raise APIError(f"tools.{i} needs a string name and an input_schema", param="tools")
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _one_call_only(choice: dict[str, Any]) -> bool:
    """`disable_parallel_tool_use`: at most one call (exactly one with any / tool), what
    chat's `parallel_tool_calls: false` means."""
    value = choice.get("disable_parallel_tool_use")
    if value is not None and not isinstance(value, bool):
        raise APIError(
            "tool_choice.disable_parallel_tool_use must be true or false", param="tool_choice"
        )
    return value is True


def chat_tool_choice(choice: Any) -> Any:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(
        "tool_choice must be {type: auto | any | none} or {type: tool, name}",
        param="tool_choice",
    )
