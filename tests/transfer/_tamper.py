"""A man in the middle of a KV transfer: real ZMQ on loopback between a consumer and a
real producer, changing the producer's answers as a fault would (bytes flipped, a
payload cut short, frames lost, the producer gone mid-transfer). Nothing of kvserve's
own code is replaced: the consumer and the producer talk through it as through a network.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from tests._ports import free_port

Edit = Callable[[int, list[bytes]], list[bytes] | None]
"""(number of the `get` answer, its frames) -> the frames passed on; None: the producer
dies now (this answer and every later one never comes)."""


class Tamper:
    def __init__(self, upstream: str, edit: Edit) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.edit = edit
        self.gets = 0
        """`get` answers seen from the producer."""
        self.dead = threading.Event()
        context: zmq.Context[Any] = zmq.Context.instance()
        self.front = context.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.LINGER, 0)
        self.front.bind(self.endpoint)
        self.back = context.socket(zmq.REQ)
        self.back.setsockopt(zmq.LINGER, 0)
        self.back.setsockopt(zmq.RCVTIMEO, 5000)
        self.back.connect(upstream)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.front.poll(50):
                continue
            peer, _, body = self.front.recv_multipart()
            if self.dead.is_set():
                continue  # gone: the ask is never answered
            self.back.send(body)
            frames = self.back.recv_multipart()
            if msgspec.msgpack.decode(body)[0] == "get":
                edited = self.edit(self.gets, frames)
                self.gets += 1
                if edited is None:
                    self.dead.set()
                    continue
                frames = edited
            self.front.send_multipart([peer, b"", *frames])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.front.close()
        self.back.close()
