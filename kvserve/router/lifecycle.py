"""SIGTERM / Ctrl-C: the router drains as a replica does, and exits 0.

The first signal stops new work (503s, /health 503) and waits up to
`shutdown_timeout` seconds for the requests in flight to end; a second one
stops at once. uvicorn's own handler would re-raise the signal after closing,
so the process would not exit 0.
"""

from __future__ import annotations

import asyncio
import logging
from types import FrameType

import uvicorn

from kvserve.router.state import RouterState

log = logging.getLogger("kvserve.router")
POLL_SECONDS = 0.05


class RouterServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: RouterState, shutdown_timeout: float):
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._now = asyncio.Event()
        self.signalled = False

    async def startup(self, sockets: list | None = None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """In the main thread between the loop's callbacks: only schedule work here."""
        loop = self._loop
        if loop is None:
            self.should_exit = True
        elif self.signalled:
            loop.call_soon_threadsafe(self._now.set)
        else:
            self.signalled = True
            loop.call_soon_threadsafe(lambda: loop.create_task(self._drain()))

    async def _drain(self) -> None:
        state = self.state
        state.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.shutdown_timeout
        if state.in_flight:
            log.info("shutting down: waiting up to %gs for %d requests", self.shutdown_timeout,
                     state.in_flight)  # fmt: skip
        while state.in_flight and loop.time() < deadline and not self._now.is_set():
            await asyncio.sleep(POLL_SECONDS)
        self.should_exit = True
