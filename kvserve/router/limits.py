"""The router's own limits: the size of a request body, the length of a relayed header.

A body is read into memory (it is tokenized and forwarded whole), so its size is bounded
before it is read: a declared Content-Length over the bound is refused at once, and a
body without one is refused as soon as it passes the bound. A replica's answer may carry
a header built from client input (the names of ignored fields); the router relays at most
`MAX_HEADER_VALUE` characters of any header, so a client can always read the answer.
"""

from __future__ import annotations

from fastapi import Request, Response

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
