"""SIGTERM / Ctrl-C: the router drains as a replica does, and exits 0.

The first signal stops new work (503s, /health 503) and waits up to
`shutdown_timeout` seconds for the requests in flight to end; a second one
stops at once. uvicorn's own handler would re-raise the signal after closing,
so the process would not exit 0.
"""

from __future__ import annotations

import asyncio
import logging

import uvicorn

from kvserve.graceful_server import GracefulServer
from kvserve.router.state import RouterState

log = logging.getLogger("kvserve.router")
POLL_SECONDS = 0.05


class RouterServer(GracefulServer):
    def __init__(self, config: uvicorn.Config, state: RouterState, shutdown_timeout: float):
        super().__init__(config, shutdown_timeout)
        self.state = state

    async def drain(self) -> None:
        state = self.state
        state.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.shutdown_timeout
        if state.in_flight:
            log.info("shutting down: waiting up to %gs for %d requests", self.shutdown_timeout,
                     state.in_flight)  # fmt: skip
        while state.in_flight and loop.time() < deadline and not self.hurry.is_set():
            await asyncio.sleep(POLL_SECONDS)
