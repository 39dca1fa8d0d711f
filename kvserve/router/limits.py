"""The router's limits: a request body's size and what the replicas refuse before tokenizing.

A body is read into memory (it is tokenized and forwarded whole), so its size is bounded
before it is read: a declared Content-Length over the bound is refused at once, and a
body without one is refused as soon as it passes the bound. Then the body is held to
the replicas' own limits (kvserve.request_limits, with the values their /kv-metadata
reports: the JSON's depth, prompts per request, a prompt's characters or token ids, n)
before the router tokenizes anything: what a replica would refuse unread, the router
refuses unread, with the replica's 400. A shape the router does not understand is the
replica's to name: the body goes on without a prediction. A replica's answer may carry
a header built from client input (the names of ignored fields); the router relays at most
`MAX_HEADER_VALUE` characters of any header, so a client can always read the answer.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import Request, Response

from kvserve.chat_template import offered_tools, openai_messages
from kvserve.prompt_fields import completion_prompts
from kvserve.request_limits import PromptLimits, check_n
from kvserve.router.errors import error

MAX_REQUEST_BYTES = 16 * 2**20
"""--max-request-bytes' default: the server's (a test checks they agree), so a body one
replica takes passes the router."""
MAX_HEADER_VALUE = 4096
CUT = ",..."


async def read_body(request: Request, limit: int) -> bytes | Response:
    """The whole body, or a 413 in OpenAI's body once it is larger than `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def too_large(limit: int) -> Response:
    message = f"the request body is larger than {limit} bytes (the router's --max-request-bytes)"
    return error(message, 413, code="request_too_large", headers={"Connection": "close"})


def bounded(value: str) -> str:
    """`value`, or its first MAX_HEADER_VALUE characters cut after a comma and marked."""
    if len(value) <= MAX_HEADER_VALUE:
        return value
    head = value[: MAX_HEADER_VALUE - len(CUT)]
    comma = head.rfind(",")
    return (head[:comma] if comma > 0 else head) + CUT


def loosest(limits: list[PromptLimits | None]) -> PromptLimits | None:
    """What every replica refuses: the loosest of their limits (None: one reports none)."""
    if not limits or any(one is None for one in limits):
        return None
    known = [one for one in limits if one is not None]
    lengths = [one.max_model_len for one in known]
    ns = [one.max_n for one in known]
    tools = [one.max_tools for one in known]
    return PromptLimits(
        None if None in lengths else max(n for n in lengths if n is not None),
        max(one.chars_per_token for one in known),
        None if None in ns else max(n for n in ns if n is not None),
        None if None in tools else max(n for n in tools if n is not None),
        all(one.tools_in_prompt for one in known),
    )


def check_request(
    limits: PromptLimits | None,
    endpoint: Literal["completions", "chat", "embeddings"],
    body: dict[str, Any],
) -> None:
    """A LimitError for what the replicas refuse before tokenizing (their own checks)."""
    if limits is None:
        return
    if endpoint == "chat":
        try:
            messages = openai_messages(body.get("messages"))
        except ValueError:
            return  # a shape the replica names
        check_n(body.get("n"), limits.max_n)
        limits.check_messages(messages, offered_tools(body.get("tools"), body.get("tool_choice")))
        return
    param = "input" if endpoint == "embeddings" else "prompt"
    try:
        completion_prompts(body.get(param))
    except ValueError:
        return
    if endpoint == "completions":
        check_n(body.get("n"), limits.max_n)
    limits.check_prompts(body.get(param), param)
