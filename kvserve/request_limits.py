"""The limits a request meets before any expensive work, one set for the server and the router.

`kvserve serve` checks them before it tokenizes (or renders) a prompt; `kvserve route`
checks the very same ones, with the values each replica reports in its /kv-metadata
(`limits`), before it tokenizes the prompt to predict its hits. So a body a replica
would refuse unread costs the router no more than it costs the replica, and the
router's refusal is the replica's (a LimitError's message and field become OpenAI's
400 on both). Pure Python and msgspec: the router's room may import it.

JSON is read at most MAX_JSON_DEPTH containers deep, the request body and a JSON string
inside it (a tool call's `arguments`) alike: deeper nesting is refused without recursion.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec

from kvserve.prompt_fields import completion_prompts

MAX_JSON_DEPTH = 32
MAX_BATCH_PROMPTS = 256
"""Prompts in one completions request, inputs in one embeddings request."""
MIN_CHARS_PER_TOKEN = 32


class LimitError(ValueError):
    """A refusal before any work: `param` names the field at fault (None: the body)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class TooDeep(LimitError):
    """JSON nested deeper than MAX_JSON_DEPTH."""


def decode_json(raw: bytes | str, what: str = "the request body") -> Any:
    """`raw` as JSON, at most MAX_JSON_DEPTH deep; a LimitError says why not."""
    try:
        value = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:
        if isinstance(exc, RecursionError) or "recursion" in str(exc).lower():
            raise TooDeep(f"{what} nests deeper than {MAX_JSON_DEPTH}") from None
        raise LimitError(f"{what} is not valid JSON: {exc}") from None
    if _deeper_than(value, MAX_JSON_DEPTH, raw):
        raise TooDeep(f"{what} nests deeper than {MAX_JSON_DEPTH}")
    return value


def decode_body(raw: bytes) -> dict[str, Any]:
    """A request body: a JSON object at most MAX_JSON_DEPTH deep."""
    body = decode_json(raw)
    if not isinstance(body, dict):
        raise LimitError("the request body must be a JSON object")
    return body


def _deeper_than(value: Any, limit: int, raw: bytes | str) -> bool:
    """More than `limit` nested arrays and objects (cheap unless the text has that many)."""
    if isinstance(raw, bytes):
        opened = raw.count(b"[") + raw.count(b"{")
    else:
        opened = raw.count("[") + raw.count("{")
    if opened <= limit:
        return False
    level = [value] if isinstance(value, dict | list) else []
    for _ in range(limit):
        level = [
            child
            for container in level
            for child in (container.values() if isinstance(container, dict) else container)
            if isinstance(child, dict | list)
        ]
        if not level:
            return False
    return bool(level)


def max_prompt_chars(max_model_len: int | None, chars_per_token: int) -> int | None:
    """The longest prompt string that could fit in max_model_len tokens (None: any)."""
    return None if max_model_len is None else max_model_len * chars_per_token


def check_prompt_chars(
    num_chars: int, max_model_len: int | None, chars_per_token: int, param: str
) -> None:
    """Text longer than any prompt that fits is refused before it is tokenized."""
    limit = max_prompt_chars(max_model_len, chars_per_token)
    if limit is not None and num_chars > limit:
        raise LimitError(
            f"the prompt is {num_chars} characters, longer than any prompt of "
            f"max_model_len ({max_model_len}) tokens can be (at most {limit})",
            param=param,
        )


def check_token_prompt(num_tokens: int, max_model_len: int | None, param: str) -> None:
    """A prompt given as token ids leaves room for one generated token."""
    if max_model_len is not None and num_tokens >= max_model_len:
        raise LimitError(
            f"the prompt is {num_tokens} tokens; max_model_len is {max_model_len}", param=param
        )


def check_batch(count: int, param: str) -> None:
    if count > MAX_BATCH_PROMPTS:
        raise LimitError(f"at most {MAX_BATCH_PROMPTS} prompts per request", param=param)


def check_n(n: Any, max_n: int | None) -> None:
    if max_n is not None and isinstance(n, int) and not isinstance(n, bool) and n > max_n:
        raise LimitError(f"n must be <= {max_n} (--max-n), got {n}"[:200], param="n")


@dataclass(frozen=True, slots=True)
class PromptLimits:
    """A replica's limits on prompts, as its /kv-metadata reports them (`as_dict`)."""

    max_model_len: int | None
    chars_per_token: int = MIN_CHARS_PER_TOKEN
    max_n: int | None = None
    max_tools: int | None = None
    """--max-tools: tools in one chat request."""
    tools_in_prompt: bool = False
    """The chat template writes the offered tools into the prompt: their JSON counts
    toward its length."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "max_model_len": self.max_model_len,
            "chars_per_token": self.chars_per_token,
            "max_prompt_chars": max_prompt_chars(self.max_model_len, self.chars_per_token),
            "max_n": self.max_n,
            "max_batch_prompts": MAX_BATCH_PROMPTS,
            "max_json_depth": MAX_JSON_DEPTH,
            "max_tools": self.max_tools,
            "tools_in_prompt": self.tools_in_prompt,
        }

    @classmethod
    def from_dict(cls, info: Any) -> PromptLimits | None:
        """None when a replica reports none (an older one: the router checks only the body)."""
        if not isinstance(info, dict) or "chars_per_token" not in info:
            return None
        return cls(
            info.get("max_model_len"),
            int(info["chars_per_token"]),
            info.get("max_n"),
            info.get("max_tools"),
            bool(info.get("tools_in_prompt", False)),
        )

    def check_prompts(self, prompt: Any, param: str) -> None:
        """A completions `prompt` or an embeddings `input` (a ValueError for a bad shape):
        how many, how long."""
        prompts = completion_prompts(prompt)
        check_batch(len(prompts), param)
        for p in prompts:  # every length checked before any is tokenized
            if isinstance(p, str):
                check_prompt_chars(len(p), self.max_model_len, self.chars_per_token, param)
            else:
                check_token_prompt(len(p), self.max_model_len, param)

    def check_messages(
        self, messages: list[dict[str, Any]], tools: list[Any] | None = None
    ) -> None:
        """Chat: the conversation's text, and the tools offered (how many; their JSON, when
        the template writes them into the prompt), before the template renders them."""
        chars = sum(len(m["content"]) for m in messages)
        check_prompt_chars(chars, self.max_model_len, self.chars_per_token, "messages")
        if not tools:
            return
        check_tools_count(len(tools), self.max_tools)
        if self.tools_in_prompt:
            chars += len(json.dumps(tools))
            check_prompt_chars(chars, self.max_model_len, self.chars_per_token, "tools")


def check_tools_count(count: int, max_tools: int | None) -> None:
    """At most --max-tools tools in one request."""
    if max_tools is not None and count > max_tools:
        raise LimitError(
            f"tools has {count} entries; at most {max_tools} (--max-tools)", param="tools"
        )
