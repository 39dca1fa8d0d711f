"""Request bodies to engine inputs: the JSON is checked here, field by field.

The body is parsed by hand instead of by a pydantic model so that every
refusal is a 400 naming the field, in OpenAI's words, and so that the checks
are the engine's own: `SamplingParams` validates values and its ValueError
names the field, which becomes the error's `param`. The JSON itself is read by
msgspec (fast; it refuses lone surrogates and integers past its range), at most
MAX_JSON_DEPTH containers deep (kvserve.request_limits: the limits the router checks
too); flags are JSON booleans, nothing else.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from kvserve import chat_template, prompt_fields, request_limits
from kvserve.chat_template import openai_messages
from kvserve.request_limits import MAX_BATCH_PROMPTS as MAX_BATCH_PROMPTS
from kvserve.request_limits import MAX_JSON_DEPTH as MAX_JSON_DEPTH
from kvserve.request_limits import LimitError
from kvserve.sampling_params import RequestOutputKind, SamplingParams
from kvserve.serve.http.errors import APIError, refusal
from kvserve.serve.request import structured

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
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "logit_bias": "logit_bias",
}
_COMMON = {
    "model",
    "stream",
    "stream_options",
    "user",
    "cache_salt",
    "priority",
    *_SAMPLING,
    *structured.FIELDS,
}
# The fields served; what happens to any other is fields.py's rule.
COMPLETION_FIELDS = frozenset({*_COMMON, "prompt", "echo", "logprobs"})
CHAT_FIELDS = frozenset(
    {*_COMMON, "messages", "logprobs", "top_logprobs", "echo"}
    | {"chat_template_kwargs", "reasoning_effort"}
    | {"tools", "tool_choice", "parallel_tool_calls"}
)
TOKENIZE_FIELDS = frozenset(
    {
        "model",
        "prompt",
        "messages",
        "add_special_tokens",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
    }
)
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})
"""/tokenize and /detokenize: any other field is a 400 naming it."""
DEFAULT_MAX_TOKENS = 16
"""Completions without max_tokens (OpenAI's default there). Chat without it: the rest of
the context (max_model_len minus the prompt), as vLLM and OpenAI answer."""


@dataclass(slots=True, frozen=True)
class ResponseOptions:
    """How the answer is shaped (not how tokens are chosen: that is SamplingParams)."""

    stream: bool = False
    include_usage: bool = False
    """Streaming: a last chunk with the usage (`stream_options.include_usage`)."""
    echo: bool = False
    """Completions: each choice's text starts with its prompt."""
    logprobs: int | None = None
    """How many most likely tokens to show per generated token (None: no logprobs)."""
    continuous_usage: bool = False
    """Streaming: usage on every chunk (`stream_options.continuous_usage_stats`, with
    include_usage, as vLLM reads it)."""


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400 that says why not."""
    try:
        return request_limits.decode_body(raw)
    except LimitError as exc:
        raise refusal(exc) from None


def check_fields(body: dict[str, Any], allowed: frozenset[str]) -> None:
    """/tokenize: an unknown field is refused by name (generation requests: fields.py)."""
    for name in body:
        if name not in allowed:
            raise APIError(f"unsupported field {name!r}", param=name)


def sampling_params(
    body: dict[str, Any],
    chat: bool = False,
    max_n: int | None = None,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
) -> SamplingParams:
    """SamplingParams from the body's sampling fields, with DELTA outputs (streaming);
    `n` at most `max_n`; `default_max_tokens` when the body sets neither max_tokens nor
    max_completion_tokens."""
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise APIError("user must be a string", param="user")
    try:
        request_limits.check_n(body.get("n"), max_n)
    except LimitError as exc:
        raise refusal(exc) from None
    kwargs: dict[str, Any] = {"max_tokens": default_max_tokens}
    for name, ours in _SAMPLING.items():
        if name in body and body[name] is not None:
            kwargs[ours] = body[name]
    top = _logprobs(body, chat)
    if top is not None:
        kwargs["logprobs"] = top  # SamplingParams checks the range and names the field
    constraint = structured.structured_outputs(body)
    if constraint is not None:
        kwargs["structured_outputs"] = constraint[0]
    try:
        return SamplingParams(**kwargs, output_kind=RequestOutputKind.DELTA)
    except (ValueError, TypeError) as exc:
        raise APIError(str(exc), param=_field_in(str(exc), chat)) from None


def sets_max_tokens(body: dict[str, Any]) -> bool:
    """The body says how long the answer may be (else chat runs to the context's end)."""
    return any(body.get(name) is not None for name in ("max_tokens", "max_completion_tokens"))


def with_max_tokens(params: SamplingParams, max_tokens: int) -> SamplingParams:
    """`params` with another max_tokens, checked again (min_tokens must still fit)."""
    try:
        return dataclasses.replace(params, max_tokens=max_tokens)
    except ValueError as exc:
        raise APIError(str(exc), param=_field_in(str(exc), True)) from None


def template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """Chat: the template's extra variables (chat_template.template_kwargs)."""
    try:
        return chat_template.template_kwargs(
            body.get("chat_template_kwargs"), body.get("reasoning_effort")
        )
    except ValueError as exc:
        param = str(exc).split(" ", 1)[0]
        raise APIError(str(exc), param=param) from None


def response_options(body: dict[str, Any], chat: bool = False) -> ResponseOptions:
    """Streaming, usage and echo flags; usage in a last chunk only when the client asks."""
    stream = flag(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIError("stream_options must be an object", param="stream_options")
    include = options.get("include_usage", False)
    continuous = options.get("continuous_usage_stats")
    continuous = False if continuous is None else continuous
    if not isinstance(include, bool) or not isinstance(continuous, bool):
        raise APIError(
            "include_usage and continuous_usage_stats must be true or false",
            param="stream_options",
        )
    return ResponseOptions(
        stream=stream,
        include_usage=include,
        continuous_usage=include and continuous,
        echo=flag(body, "echo"),
        logprobs=_logprobs(body, chat),
    )


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """Completions: `logprobs: N`. Chat: `logprobs: true` and `top_logprobs: N` (0 default)."""
    if not chat:
        value = body.get("logprobs")
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise APIError("logprobs must be an integer", param="logprobs")
        return value
    top = body.get("top_logprobs")
    if not flag(body, "logprobs"):
        if top is not None:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
        return None
    if top is None:
        return 0
    if not isinstance(top, int) or isinstance(top, bool):
        raise APIError("top_logprobs must be an integer", param="top_logprobs")
    return top


def cache_salt(body: dict[str, Any]) -> str | None:
    """vLLM's `cache_salt`: requests with different salts never share cached blocks."""
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise APIError("cache_salt must be a non-empty string", param="cache_salt")
    return salt


def flag(body: dict[str, Any], name: str, default: bool = False) -> bool:
    """A JSON boolean (null: `default`); "", 0 or "yes" are refused, not read as one."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(f"{name} must be true or false", param=name)
    return value


def completion_prompts(body: dict[str, Any]) -> list[str | list[int]]:
    """The prompts: a string, a list of token ids, or a list of either (a batch)."""
    try:
        prompts = prompt_fields.completion_prompts(body.get("prompt"))
    except ValueError as exc:
        raise APIError(str(exc), param="prompt") from None
    try:
        request_limits.check_batch(len(prompts), "prompt")
    except LimitError as exc:
        raise refusal(exc) from None
    return prompts


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation; content given as text parts is joined into one string."""
    try:
        return openai_messages(body.get("messages"))
    except ValueError as exc:
        raise APIError(str(exc), param="messages") from None


def _field_in(message: str, chat: bool) -> str | None:
    """The field a SamplingParams error names (its messages start with the field)."""
    match = re.match(r"(\w+)", message)
    name = match.group(1) if match else None
    if name == "logprobs":
        return "top_logprobs" if chat else "logprobs"
    reverse = {ours: name for name, ours in _SAMPLING.items()}
    return name if name in _SAMPLING or name in reverse else None


def refused_field(message: str) -> str | None:
    """The field behind the engine's refusal of a request (its message names it)."""
    for name in ("logit_bias", "max_tokens"):
        if name in message:
            return name
    return None
