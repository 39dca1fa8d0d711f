"""A uvicorn server that drains on SIGTERM / Ctrl-C instead of stopping at once.

uvicorn's own handler stops straight away and re-raises the signal once
closed (so the process dies by it, not with exit code 0). Here the first
signal runs the subclass's `drain` (on the event loop; it decides what
"draining" means), then closes; a second signal sets `hurry`, which `drain`
watches to skip its wait. `kvserve serve` and `kvserve route` share it.

It also quiets one ordinary event: a client that leaves while sending its body
makes the handler's body read raise ClientDisconnect, which uvicorn would log
as an ERROR with a full traceback (500 slow sockets: ~10,000 lines). Here it is
one line, at most one every `DISCONNECT_LOG_SECONDS`, counting the others
(`LogEvery`, which the server uses for its own client-caused events too).
"""

from __future__ import annotations

import asyncio
import logging
import time
from types import FrameType
from typing import cast

import uvicorn
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger("kvserve.server")
DISCONNECT_LOG_SECONDS = 10.0


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, shutdown_timeout: float) -> None:
        # uvicorn's app type admits ASGI2 classes too; an app given here is an ASGI3 one
        if not isinstance(config.app, str):
            config.app = QuietDisconnects(cast(ASGIApp, config.app))
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout
        self.hurry = asyncio.Event()
        """Set by a second signal: stop waiting."""
        self.signalled = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Runs in the main thread between the loop's callbacks: only schedule work here."""
        loop = self._loop
        if loop is None:  # not started yet: nothing to drain
            self.should_exit = True
        elif self.signalled:
            loop.call_soon_threadsafe(self.hurry.set)
        else:
            self.signalled = True
            loop.call_soon_threadsafe(lambda: loop.create_task(self._drain_then_exit()))

    async def _drain_then_exit(self) -> None:
        try:
            await self.drain()
        finally:
            self.should_exit = True

    async def drain(self) -> None:
        """Stop new work and wait (up to `shutdown_timeout`, or until `hurry`)."""
        raise NotImplementedError


class LogEvery:
    """One line (not a traceback) per `seconds` for an event clients cause at will,
    with how many there were so far (serve and route share it)."""

    def __init__(
        self, what: str, logger: logging.Logger = log, seconds: float = DISCONNECT_LOG_SECONDS
    ) -> None:
        self.what = what
        self.logger = logger
        self.seconds = seconds
        self.count = 0
        self._last = float("-inf")

    def note(self) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self._last >= self.seconds:
            self._last = now
            self.logger.info("%s (%d so far)", self.what, self.count)


class QuietDisconnects:
    """ASGI wrapper: ClientDisconnect out of the app is one rate-limited line, not a traceback
    (there is no one left to answer)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.disconnects = LogEvery("a client left while sending its request")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        except ClientDisconnect:
            self.disconnects.note()
