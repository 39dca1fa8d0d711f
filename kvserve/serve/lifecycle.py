"""Graceful shutdown: SIGTERM or Ctrl-C drains the server instead of dropping requests.

uvicorn's own handler stops at once and re-raises the signal afterwards (so
the process dies by it, not with exit code 0). Here the first signal starts a
drain: new requests get a 503 and /health turns 503, running requests finish
for up to `shutdown_timeout` seconds, what is left is aborted (its streams end
with finish_reason "abort"), and only then does uvicorn close. A second signal
skips the wait. The caller then stops the engine thread, which sends the last
KV events and finishes the tiers' writes.

If the engine thread dies, the server stops at once (after DEATH_GRACE_SECONDS
for the handlers to send their errors) and the process exits non-zero.
"""

from __future__ import annotations

import asyncio
import logging

import uvicorn

from kvserve.graceful_server import GracefulServer
from kvserve.serve.state import ServerState

log = logging.getLogger("kvserve.serve")
POLL_SECONDS = 0.05
ABORT_GRACE_SECONDS = 2.0
"""After aborting: time for the handlers to send their last chunks before connections close."""
DEATH_GRACE_SECONDS = 0.5


class DrainingServer(GracefulServer):
    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float):
        super().__init__(config, shutdown_timeout)
        self.state = state

    def engine_died(self, reason: str) -> None:
        """The engine thread died (called there): stop serving, soon, from the loop."""
        loop = self._loop
        if loop is None:
            self.should_exit = True
            return
        log.error("the engine died (%s): the server stops", reason)
        loop.call_soon_threadsafe(loop.call_later, DEATH_GRACE_SECONDS, self._exit_now)

    def _exit_now(self) -> None:
        self.should_exit = True

    async def drain(self) -> None:
        state = self.state
        state.draining = True
        engine = state.engine
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.shutdown_timeout
        if not engine.idle():
            log.info(
                "shutting down: waiting up to %gs for running requests (again to stop now)",
                self.shutdown_timeout,
            )
        while not engine.idle() and loop.time() < deadline and not self.hurry.is_set():
            await asyncio.sleep(POLL_SECONDS)
        if not engine.idle():
            log.info("shutting down: aborting the requests still running")
            engine.abort_all()
            grace = loop.time() + ABORT_GRACE_SECONDS
            while not engine.idle() and loop.time() < grace:
                await asyncio.sleep(POLL_SECONDS)
        await asyncio.sleep(POLL_SECONDS)  # let the handlers send their last chunks
