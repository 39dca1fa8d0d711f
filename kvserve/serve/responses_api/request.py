"""A `/v1/responses` body -> the chat-completions body the chat path runs.

The Responses API is chat in other words: `input` items become chat messages
(a `function_call` item an assistant message's tool call, a
`function_call_output` item a `tool` message), `instructions` a system message
first, `max_output_tokens` max_tokens, `text.format` response_format, function
tools chat's function tools. Nothing here renders or tokenizes: the chat path
does (generation/prompts.chat_prompt), so both APIs get one prompt for one
conversation, and a continued conversation renders as its first turn did
(the prefix cache hits it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.serve.http.errors import APIError
from kvserve.serve.request.fields import Unsupported, strict_fields
from kvserve.serve.request.protocol import flag

SERVED = frozenset(
    {
        "model",
        "input",
        "instructions",
        "max_output_tokens",
        "temperature",
        "top_p",
        "tools",
        "tool_choice",
        "text",
        "stream",
        "previous_response_id",
        "store",
        "metadata",
        "parallel_tool_calls",
    }
)
IGNORED = frozenset(
    {"user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "service_tier"}
)
"""Documented fields that change nothing in the answer: accepted, named in the header."""
REFUSED: dict[str, Unsupported] = {
    "include": Unsupported("extra output data (include)", ([],)),
    "reasoning": Unsupported("reasoning options", ({},)),
    "truncation": Unsupported("truncation", ("disabled",)),
    "background": Unsupported("background responses", (False,)),
    "conversation": Unsupported("conversations (use previous_response_id)"),
    "prompt": Unsupported("prompt templates"),
    "max_tool_calls": Unsupported("max_tool_calls"),
    "top_logprobs": Unsupported("logprobs", (0,)),
    "context_management": Unsupported("context management"),
    "stream_options": Unsupported("stream options", ({},)),
}
"""Fields that would change the answer: a 400 naming them unless their value is neutral."""
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
MAX_IDENTIFIER = 64
"""`user`, `safety_identifier`, `prompt_cache_key`: characters at most (OpenAI's bound)."""
PARAMS = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text"}
"""Chat's name of a field -> the Responses API's, for an error the chat path raises."""


@dataclass(slots=True)
class Translated:
    chat: dict[str, Any]
    """The chat-completions body that runs the request."""
    conversation: list[dict[str, Any]]
    """The chat messages without `instructions` (what a stored response carries on)."""
    ignored: list[str]


def translate(body: dict[str, Any], history: list[dict[str, Any]]) -> Translated:
    """`history`: the conversation of `previous_response_id` (its instructions not
    included, as OpenAI does not carry them over)."""
    ignored = strict_fields(body, SERVED, IGNORED, REFUSED)
    check_kept_fields(body)
    conversation = [*history, *input_messages(body.get("input"))]
    messages = list(conversation)
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise APIError("instructions must be a string", param="instructions")
        messages.insert(0, {"role": "system", "content": instructions})
    chat: dict[str, Any] = {"messages": messages}
    for ours, theirs in (("model", "model"), ("temperature", "temperature"), ("top_p", "top_p")):
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        chat["tools"] = chat_tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = chat_tool_choice(body["tool_choice"])
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    response_format = chat_response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    if flag(body, "stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return Translated(chat, conversation, ignored)


def check_kept_fields(body: dict[str, Any]) -> None:
    """OpenAI's bounds on what a stored response keeps as sent: `metadata` (16 pairs of
    strings, keys up to 64 characters, values up to 512) and the identifiers (64). `tools`
    are bounded as chat bounds them (the body's size), `input` by the prompt's."""
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise APIError("metadata must be an object of strings", param="metadata")
        if len(metadata) > MAX_METADATA_PAIRS:
            raise APIError(
                f"metadata has {len(metadata)} pairs; at most {MAX_METADATA_PAIRS}",
                param="metadata",
            )
        for key, value in metadata.items():
            if len(key) > MAX_METADATA_KEY:
                raise APIError(
                    f"metadata keys are at most {MAX_METADATA_KEY} characters, got {len(key)}",
                    param="metadata",
                )
            if not isinstance(value, str) or len(value) > MAX_METADATA_VALUE:
                raise APIError(
                    f"metadata[{key!r}] must be a string of at most {MAX_METADATA_VALUE} "
                    "characters",
                    param="metadata",
                )
    for name in ("user", "safety_identifier", "prompt_cache_key"):
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, str) or len(value) > MAX_IDENTIFIER:
            raise APIError(
                f"{name} must be a string of at most {MAX_IDENTIFIER} characters", param=name
            )


def input_messages(items: Any) -> list[dict[str, Any]]:
    """`input`: a string (one user message) or a list of items, as chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise APIError("input must be a string or a non-empty list of items", param="input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise APIError(f"input[{i}] must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, i))
        elif kind == "function_call":
            function = {"name": _text(item, "name", i), "arguments": _text(item, "arguments", i)}
            call = {"id": _text(item, "call_id", i), "type": "function", "function": function}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            elif last is not None and last["role"] == "assistant":
                last["tool_calls"] = [call]  # the text said before the call, then the call
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = _content(output, i) if isinstance(output, list) else output
            if not isinstance(content, str):
                raise APIError(f"input[{i}].output must be a string", param="input")
            call_id = _text(item, "call_id", i)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
        else:
            raise APIError(
                f"input[{i}]: items of type {str(kind)[:40]!r} are not served "
                "(message, function_call, function_call_output are)",
                param="input",
            )
    return messages


_ROLES = ("user", "system", "developer", "assistant")


def _message(item: dict[str, Any], i: int) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise APIError(f"input[{i}].role must be one of {', '.join(_ROLES)}", param="input")
    content = item.get("content")
    text = _content(content, i) if isinstance(content, list) else content
    if not isinstance(text, str):
        raise APIError(f"input[{i}].content must be a string or a list of parts", param="input")
    return {"role": role, "content": text}


_TEXT_PARTS = ("input_text", "output_text", "text")


def _content(parts: list[Any], i: int) -> str:
    """Text parts joined (input_text, output_text); images and files are refused."""
    texts = []
    for part in parts:
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(
                f"input[{i}]: content parts of type {str(kind)[:40]!r} are not served "
                "(input_text and output_text are)",
                param="input",
            )
        if not isinstance(part.get("text"), str):
            raise APIError(f"input[{i}]: a text part needs a string 'text'", param="input")
        texts.append(part["text"])
    return "".join(texts)


def _text(item: dict[str, Any], name: str, i: int) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise APIError(f"input[{i}].{name} must be a string", param="input")
    return value


def chat_tools(tools: Any) -> list[dict[str, Any]]:
    """Function tools (`{type, name, description, parameters, strict}`) as chat's."""
    if not isinstance(tools, list):
        raise APIError("tools must be a list", param="tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise APIError(
                f"tools[{i}]: only function tools are served, not {str(kind)[:40]!r}",
                param="tools",
            )
        if not isinstance(tool.get("name"), str):
            raise APIError(f"tools[{i}] needs a string 'name'", param="tools")
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        if tool.get("strict") is not None:
            function["strict"] = tool["strict"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """ "auto" / "none" / "required" as they are; `{type: function, name}` as chat's."""
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        if not isinstance(choice.get("name"), str):
            raise APIError("tool_choice needs the function's name", param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(
        'tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}',
        param="tool_choice",
    )


def chat_response_format(text: Any) -> dict[str, Any] | None:
    """`text.format`: text, json_object, or json_schema (name, schema, strict)."""
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format"}:
        raise APIError("text must be an object with 'format'", param="text")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise APIError("text.format.type must be text, json_object or json_schema", param="text")
