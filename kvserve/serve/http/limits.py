"""What one client may take: the server's limits, and the request body's (size and time).

Every limit answers in OpenAI's error body and names its option: a body over
`--max-request-bytes` is a 413 (refused from its Content-Length before a byte
of it is read, or as soon as the bytes read pass it), a body still arriving
after `--body-timeout` seconds a 408. The connection-level timeouts (idle
keep-alive, headers, a client that stops reading) are connections.py's.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.serve.http.errors import APIError, error_response

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class ServeLimits:
    """`kvserve serve`'s limits on one client (each an option of the same name)."""

    max_request_bytes: int = 16 * MIB
    """A request body's size (413 past it)."""
    max_n: int | None = None
    """Completions per prompt (`n`); None: the engine's max_num_seqs."""
    body_timeout: float = 60.0
    """Seconds a request body may take to arrive (408 past it)."""
    header_timeout: float = 10.0
    """Seconds a connection may take to send a request's headers (closed past it)."""
    keep_alive_timeout: float = 5.0
    """Seconds an idle keep-alive connection is kept."""
    send_timeout: float = 30.0
    """Seconds a response may wait for a client that does not read (dropped past it)."""
    max_grammar_values: int = 4096
    """Enum, const and choice values one request's constraint may hold (a schema's, the
    choices', the tools' together): their compile grows faster than their number."""
    max_grammar_bytes: int = 256 * 1024
    """Bytes of one request's constraint text (a schema, regex, grammar, the tools')."""
    max_tools: int = 128
    """Tools one chat request may offer (OpenAI's limit)."""
    max_chars_per_token: int = 32
    """Characters one prompt token may cover at most (a generous bound of the checkpoint's
    longest token): a prompt string longer than max_model_len times this cannot fit, and
    is refused without tokenizing it."""


class BodyLimits:
    """ASGI middleware: the request body's size and time limits, enforced as it arrives."""

    def __init__(self, app: ASGIApp, limits: ServeLimits) -> None:
        self.app = app
        self.max_bytes = limits.max_request_bytes
        self.timeout = limits.body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length")
        if length is not None and (not length.isdigit() or len(length) > 18):
            await error_response(APIError("Content-Length must be a number"))(scope, receive, send)
            return
        if length is not None and int(length) > self.max_bytes:
            await error_response(self._too_large())(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        received = 0
        complete = False

        async def limited() -> Message:
            nonlocal received, complete
            if complete:  # after the body: the disconnect a streaming response listens for
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise APIError(
                    f"the request body did not arrive within {self.timeout:g}s (--body-timeout)",
                    408,
                    headers={"Connection": "close"},
                ) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._too_large()
                complete = not message.get("more_body", False)
            else:
                complete = True
            return message

        await self.app(scope, limited, send)

    def _too_large(self) -> APIError:
        return APIError(
            f"the request body is larger than {self.max_bytes} bytes (--max-request-bytes)",
            413,
            headers={"Connection": "close"},
        )
