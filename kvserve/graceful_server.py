"""A uvicorn server that drains on SIGTERM / Ctrl-C instead of stopping at once.

uvicorn's own handler stops straight away and re-raises the signal once
closed (so the process dies by it, not with exit code 0). Here the first
signal runs the subclass's `drain` (on the event loop; it decides what
"draining" means), then closes; a second signal sets `hurry`, which `drain`
watches to skip its wait. `kvserve serve` and `kvserve route` share it.
"""

from __future__ import annotations

import asyncio
from types import FrameType

import uvicorn


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, shutdown_timeout: float) -> None:
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
