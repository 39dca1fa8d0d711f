"""Request bodies to engine inputs: the JSON is checked here, field by field.

The body is parsed by hand instead of by a pydantic model so that every
refusal is a 400 naming the field, in OpenAI's words, and so that the checks
are the engine's own: `SamplingParams` validates values and its ValueError
names the field, which becomes the error's `param`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from kvserve.sampling_params import RequestOutputKind, SamplingParams
from kvserve.serve.errors import APIError

# Fields accepted and passed on to SamplingParams (OpenAI's name -> ours).
_SAMPLING = {
    "max_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "n": "n",
    "seed": "seed",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "min_tokens": "min_tokens",
    "skip_special_tokens": "skip_special_tokens",
    "include_stop_str_in_output": "include_stop_str_in_output",
}
_COMMON = {"model", "stream", "stream_options", "user", "cache_salt", *_SAMPLING}
COMPLETION_FIELDS = frozenset({*_COMMON, "prompt", "echo"})
CHAT_FIELDS = frozenset({*_COMMON, "messages"})
DEFAULT_MAX_TOKENS = 16
MAX_BATCH_PROMPTS = 256


@dataclass(slots=True, frozen=True)
class ResponseOptions:
    """How the answer is shaped (not how tokens are chosen: that is SamplingParams)."""

    stream: bool = False
    include_usage: bool = False
    """Streaming: a last chunk with the usage (`stream_options.include_usage`)."""
    echo: bool = False
    """Completions: each choice's text starts with its prompt."""


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400 that says why not."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    return body


def check_fields(body: dict[str, Any], allowed: frozenset[str]) -> None:
    """An unknown field is refused by name: silently ignoring it would change the answer."""
    for name in body:
        if name not in allowed:
            raise APIError(f"unsupported field {name!r}", param=name)


def sampling_params(body: dict[str, Any], chat: bool = False) -> SamplingParams:
    """SamplingParams from the body's sampling fields, with DELTA outputs (streaming)."""
    kwargs: dict[str, Any] = {"max_tokens": DEFAULT_MAX_TOKENS}
    for name, ours in _SAMPLING.items():
        if name in body and body[name] is not None:
            kwargs[ours] = body[name]
    try:
        return SamplingParams(**kwargs, output_kind=RequestOutputKind.DELTA)
    except (ValueError, TypeError) as exc:
        raise APIError(str(exc), param=_field_in(str(exc))) from None


def response_options(body: dict[str, Any], chat: bool = False) -> ResponseOptions:
    """Streaming, usage and echo flags; usage in a last chunk only when the client asks."""
    stream = _flag(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIError("stream_options must be an object", param="stream_options")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise APIError("include_usage must be true or false", param="stream_options")
    return ResponseOptions(stream=stream, include_usage=include, echo=_flag(body, "echo"))


def cache_salt(body: dict[str, Any]) -> str | None:
    """vLLM's `cache_salt`: requests with different salts never share cached blocks."""
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise APIError("cache_salt must be a non-empty string", param="cache_salt")
    return salt


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name) or False
    if not isinstance(value, bool):
        raise APIError(f"{name} must be true or false", param=name)
    return value


def completion_prompts(body: dict[str, Any]) -> list[str | list[int]]:
    """The prompts: a string, a list of token ids, or a list of either (a batch)."""
    prompt = body.get("prompt")
    if _is_ids(prompt) or isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        prompts = prompt
    else:
        raise APIError(
            "prompt must be a string, a list of token ids, or a list of either", param="prompt"
        )
    if len(prompts) > MAX_BATCH_PROMPTS:
        raise APIError(f"at most {MAX_BATCH_PROMPTS} prompts per request", param="prompt")
    for i, p in enumerate(prompts):
        if not (isinstance(p, str) and p) and not _is_ids(p):
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            raise APIError(
                f"{where} must be a non-empty string or list of token ids", param="prompt"
            )
    return prompts


def _is_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation; content given as text parts is joined into one string."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("messages must be a non-empty list", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise APIError(f"messages[{i}] needs a string 'role'", param="messages")
        content = message.get("content")
        if isinstance(content, list):
            parts = [p.get("text") for p in content if isinstance(p, dict)]
            if len(parts) != len(content) or not all(isinstance(p, str) for p in parts):
                raise APIError(f"messages[{i}]: only text content parts", param="messages")
            content = "".join(parts)  # type: ignore[arg-type]
        if not isinstance(content, str):
            raise APIError(f"messages[{i}] needs a string 'content'", param="messages")
        out.append({"role": message["role"], "content": content})
    return out


def _field_in(message: str) -> str | None:
    """The field a SamplingParams error names (its messages start with the field)."""
    match = re.match(r"(\w+)", message)
    name = match.group(1) if match else None
    reverse = {ours: name for name, ours in _SAMPLING.items()}
    return name if name in _SAMPLING or name in reverse else None
