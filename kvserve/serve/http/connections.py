"""Connections that hold nothing for long: uvicorn's h11 protocol with two more timers.

uvicorn closes a keep-alive connection idle after a response (its
`timeout_keep_alive`), but it starts no timer before the first request and
stops its timer at the first byte: a client that connects and sends nothing,
or a header a byte at a time, holds its connection for ever. Here:

- headers: a connection must have sent a request's complete headers within
  `header_timeout` seconds of opening, or of its previous response; else it is
  closed (the body's own time limit is limits.py's).
- a client that does not read: once the socket's buffers are full (the
  transport pauses writing), it has `send_timeout` seconds to read on; else
  the connection is dropped. A stream waiting on it ends as a disconnect does:
  its request is aborted and its KV blocks freed.
"""

from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvserve.graceful_server import LogEvery

log = logging.getLogger("kvserve.serve")


def timed_h11(header_timeout: float, send_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the header and send timers (`uvicorn.Config(http=...)`)."""
    dropped = LogEvery(
        f"dropped a client that read nothing for {send_timeout:g}s (--send-timeout)", log
    )

    class TimedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _send_timer: asyncio.TimerHandle | None = None

        def connection_made(  # type: ignore[override]  # uvicorn's: narrower than asyncio's
            self, transport: asyncio.Transport
        ) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            for timer in (self._header_timer, self._send_timer):
                if timer is not None:
                    timer.cancel()
            super().connection_lost(exc)

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._send_timer is None:
                self._send_timer = self.loop.call_later(send_timeout, self._reader_gone)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._send_timer is not None:
                self._send_timer.cancel()
                self._send_timer = None

        def _arm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(header_timeout, self._headers_due)

        def _headers_due(self) -> None:
            self._header_timer = None
            waiting = self.cycle is None or self.cycle.response_complete
            if waiting and self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                log.debug("closing a connection that sent no request in %gs", header_timeout)
                self.transport.close()

        def _reader_gone(self) -> None:
            self._send_timer = None
            if not self.transport.is_closing():
                dropped.note()
                self.transport.abort()

    return TimedH11Protocol
