"""The producer's side: its tiers' blocks served to consumers over ZMQ.

One thread, one ROUTER socket, no authentication: bind it (`kv_ip`) to a private
network only. A request names the fingerprint the consumer's blocks are keyed under
(model, dtype, layout, block size, hashing: the tiers' own) and the keys it wants, as
many as a request's prompt needs (up to MAX_KEYS): one round trip per request, not one
per block. The answer is a header frame (per key: the payload's xxh3_64, or None for a
block not held) and then one frame per block held, sent without a copy out of the CPU
tier, so the consumer can tell a block that arrived whole from one that did not; the
blocks served are released from the tier's keeping (kvserve.offload.cpu_tier: they were
held for this pull). A consumer whose fingerprint differs gets nothing: its blocks would
not fit.
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
"""Keys one request may ask for (a consumer splits a longer run into several asks)."""


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
            except Exception as exc:  # a malformed request: an error answer, never a crash
                log.warning("KV transfer: a malformed request (%s)", exc)
                reply = [msgspec.msgpack.encode(["error", str(exc)[:200]])]
            self.socket.send_multipart([peer, b"", *reply], copy=False)
        self.socket.close()

    def _answer(self, body: bytes) -> list[bytes]:
        op, fingerprint, keys = msgspec.msgpack.decode(body)
        if not isinstance(keys, list) or len(keys) > MAX_KEYS:
            raise ValueError(f"keys must be a list of at most {MAX_KEYS}")
        if not all(isinstance(k, bytes) for k in keys):
            raise ValueError("keys must be bytes")
        if fingerprint != self.fingerprint:
            return [msgspec.msgpack.encode(["fingerprint", None])]
        if op == "contains":
            return [msgspec.msgpack.encode(["ok", self.store.contains_many(keys, remote=False)])]
        if op != "get":
            raise ValueError(f"unknown op {op!r}")
        checksums: list[int | None] = []
        payloads: list[bytes] = []
        served: list[bytes] = []
        for key, data in zip(keys, self.store.get_many(keys, remote=False), strict=True):
            if data is None:
                checksums.append(None)
                continue
            checksums.append(xxhash.xxh3_64_intdigest(data))
            payloads.append(data)
            served.append(key)
            self.blocks_served += 1
            self.bytes_served += len(data)
        self.store.release(served)  # pulled: the tier need not keep them any longer
        return [msgspec.msgpack.encode(["ok", checksums]), *payloads]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
