"""A stand-in replica for faults a real one shows only by chance: it answers /health and
/kv-metadata (a real replica's, edited as a test needs) and drops every other request
without a byte, as a replica that dies between accepting a connection and answering; or,
with `hang`, never answers it, as a replica stuck mid-request, and counts the requests
whose client left (`abandoned`)."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class StandIn:
    def __init__(self, info: dict[str, Any], hang: bool = False) -> None:
        self.info = info
        self.dropped = 0
        self.hanging = 0
        """Requests it holds without answering (`hang`)."""
        self.abandoned = 0
        """Of those, the ones whose client closed the connection."""
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                if self.path == "/health":
                    self._answer(b"")
                elif self.path == "/kv-metadata":
                    self._answer(json.dumps(standin.info).encode())
                else:
                    self._drop()

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                if not hang:
                    self._drop()
                    return
                standin.hanging += 1
                self.connection.settimeout(120)
                try:
                    if self.rfile.read(1) == b"":  # the client closed its connection
                        standin.abandoned += 1
                except OSError:
                    pass
                self.close_connection = True

            def _answer(self, body: bytes) -> None:
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _drop(self) -> None:
                standin.dropped += 1
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
