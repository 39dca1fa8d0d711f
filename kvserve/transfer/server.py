"""The producer's side: its tiers' blocks served to consumers over ZMQ.

One thread, one ROUTER socket, no authentication: bind it (`kv_ip`) to a private
network only. A request names the fingerprint the consumer's
blocks are keyed under (model, dtype, layout, block size, hashing: the tiers' own)
and the keys it wants; the answer is each payload (or nothing) with its xxh64, so
the consumer can tell a block that arrived whole from one that did not. A
consumer whose fingerprint differs gets nothing: its blocks would not fit.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import msgspec
import xxhash
import zmq

from kvserve.offload.store import TierStack

log = logging.getLogger("kvserve.transfer")

MAX_REQUEST_BYTES = 1 << 20
"""A larger request is dropped by ZMQ itself (its peer's connection closed)."""
MAX_KEYS = 1024
"""Keys one request may ask for (a consumer asks for one)."""


class BlockServer:
    """Serves `store`'s blocks on `endpoint` until `close`."""

    def __init__(self, store: TierStack, fingerprint: bytes, endpoint: str) -> None:
        self.store = store
        self.fingerprint = fingerprint
        self.context: zmq.Context[Any] = zmq.Context.instance()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        try:
            self.socket.bind(endpoint)
        except zmq.ZMQError as exc:
            self.socket.close()
            raise ValueError(f"kv_transfer_config: cannot serve on {endpoint}: {exc}") from None
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        """Where it listens (the port ZMQ chose for `tcp://host:*`)."""
        self.blocks_served = 0
        self.bytes_served = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvserve-transfer", daemon=True)
        self._thread.start()
        log.info("KV transfer: serving this engine's blocks on %s", self.endpoint)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self.socket.recv_multipart()
            peer, body = frames[0], frames[-1]
            try:
                reply = self._answer(body)
            except Exception as exc:  # a malformed request: an empty answer, never a crash
                log.warning("KV transfer: a malformed request (%s)", exc)
                reply = msgspec.msgpack.encode(["error", str(exc)[:200]])
            self.socket.send_multipart([peer, b"", reply])
        self.socket.close()

    def _answer(self, body: bytes) -> bytes:
        op, fingerprint, keys = msgspec.msgpack.decode(body)
        if not isinstance(keys, list) or len(keys) > MAX_KEYS:
            raise ValueError(f"keys must be a list of at most {MAX_KEYS}")
        if fingerprint != self.fingerprint:
            return msgspec.msgpack.encode(["fingerprint", None])
        if op == "contains":
            return msgspec.msgpack.encode(["ok", [self.store.contains(k) for k in keys]])
        if op != "get":
            raise ValueError(f"unknown op {op!r}")
        payloads = []
        for key in keys:
            data = self.store.get(key)
            if data is not None:
                self.blocks_served += 1
                self.bytes_served += len(data)
            payloads.append(None if data is None else (data, xxhash.xxh64_intdigest(data)))
        return msgspec.msgpack.encode(["ok", payloads])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
