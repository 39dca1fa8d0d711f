"""The consumer's side: a producer's blocks as one more tier, read-only.

The offload connector looks a request's run of blocks up at once (`contains_many`,
`get_many`); this tier asks a producer (server.py) for the whole run over a ZMQ REQ
socket: one round trip per MAX_KEYS keys, not one per block. Each block's checksum is
checked on its own, so a corrupt block is a miss while the blocks before it are used.
Whatever goes wrong (a producer gone or slow past `timeout_s`, another fingerprint, an
answer that does not parse, a payload whose checksum does not match) is a miss: the
consumer computes that block, and what follows it, itself. A producer that failed is
not asked again for a few seconds, so a dead one costs one timeout, not one per request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import xxhash
import zmq

from kvserve.transfer.server import MAX_KEYS, MAX_REQUEST_BYTES

log = logging.getLogger("kvserve.transfer")

BACKOFF_SECONDS = 5.0
KEY_BUDGET = MAX_REQUEST_BYTES // 2
"""Key bytes one ask carries at most (the rest of the request is a few bytes of framing)."""
HEADER_BYTES = 16 * MAX_KEYS + 64
"""An answer's header frame at most: a status and a checksum (or nil) per key."""


class ReadOnlyTier:
    """A tier the offload stack reads and never writes (kvserve.offload.tiers' interface):
    one key at a time is a run of one; what it holds is someone else's."""

    medium = "REMOTE"
    read_only = True
    capacity = 0
    used_bytes = 0

    @staticmethod
    def stored_size(key_bytes: int, payload_bytes: int) -> int:
        return 0

    def contains(self, key: bytes) -> bool:
        return self.contains_many([key])[0]

    def get(self, key: bytes) -> bytes | None:
        return self.get_many([key])[0]

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        raise NotImplementedError

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        raise NotImplementedError

    def put(self, key: bytes, payload: bytes) -> list[bytes]:
        return []  # the producer's tiers are its own

    def keys(self) -> list[bytes]:
        return []


class RemoteTier(ReadOnlyTier):
    """A producer's tiers, read through the network; never written."""

    def __init__(
        self, endpoint: str, fingerprint: bytes, timeout_s: float, largest_payload: int = 0
    ) -> None:
        self.endpoint = endpoint
        self.fingerprint = fingerprint
        self.timeout_ms = int(timeout_s * 1000)
        self.max_frame = max(largest_payload, HEADER_BYTES) if largest_payload else -1
        """A frame larger than any block (or than a header) is refused unread (ZMQ drops
        the connection): one ask holds at most MAX_KEYS blocks (-1: no bound)."""
        self.context: zmq.Context[Any] = zmq.Context.instance()
        self.socket: Any = None
        self._lock = threading.Lock()
        self._down_until = 0.0
        self.blocks_received = 0
        self.bytes_received = 0
        self.asks = 0
        """Round trips that were answered."""
        self.rejected = 0
        """Payloads whose checksum did not match (recomputed instead)."""
        self.failures = 0
        """Asks that got no usable answer (gone, slow, another model's blocks): recomputed."""
        self.seconds = 0.0
        """Time spent asking."""

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        found = [False] * len(keys)
        for lo, hi in _batches(keys):
            answer = self._ask("contains", keys[lo:hi])
            if answer is None:
                break
            header, _ = answer
            if not isinstance(header, list) or len(header) != hi - lo:
                self._failed("answered contains with the wrong number of keys")
                break
            found[lo:hi] = [bool(x) for x in header]
        return found

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Each key's payload, verified, or None (not held, not answered, corrupt)."""
        out: list[bytes | None] = [None] * len(keys)
        for lo, hi in _batches(keys):
            answer = self._ask("get", keys[lo:hi])
            if answer is None:
                break
            checksums, frames = answer
            held = checksums if isinstance(checksums, list) else []
            if len(held) != hi - lo or sum(c is not None for c in held) != len(frames):
                self._failed("answered with frames that do not match its header")
                break
            it = iter(frames)
            for i, checksum in enumerate(held, lo):
                if checksum is None:
                    continue
                data = next(it)
                if not isinstance(checksum, int) or xxhash.xxh3_64_intdigest(data) != checksum:
                    self.rejected += 1
                    log.warning(
                        "KV transfer: a block from %s failed its checksum: recomputed",
                        self.endpoint,
                    )
                    continue
                self.blocks_received += 1
                self.bytes_received += len(data)
                out[i] = data
        return out

    def _ask(self, op: str, keys: Sequence[bytes]) -> tuple[Any, list[bytes]] | None:
        with self._lock:
            if time.monotonic() < self._down_until:
                return None
            started = time.perf_counter()
            try:
                return self._ask_locked(op, keys)
            finally:
                self.seconds += time.perf_counter() - started

    def _ask_locked(self, op: str, keys: Sequence[bytes]) -> tuple[Any, list[bytes]] | None:
        """One round trip (the lock held): the answer's header and block frames, or None."""
        if self.socket is None:
            self.socket = self.context.socket(zmq.REQ)
            self.socket.setsockopt(zmq.LINGER, 0)
            self.socket.setsockopt(zmq.RCVTIMEO, self.timeout_ms)
            self.socket.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
            self.socket.setsockopt(zmq.MAXMSGSIZE, self.max_frame)
            self.socket.connect(self.endpoint)
        try:
            self.socket.send(msgspec.msgpack.encode([op, self.fingerprint, list(keys)]))
            head, *frames = self.socket.recv_multipart()
        except zmq.ZMQError:  # gone or slow: a REQ socket that missed its reply is reset
            self.socket.close()
            self.socket = None
            self._failed("did not answer")
            return None
        try:
            status, value = msgspec.msgpack.decode(head)
        except (msgspec.DecodeError, TypeError, ValueError):
            self._failed("answered something that is not a KV transfer answer")
            return None
        if status != "ok":
            why = "holds another model's blocks" if status == "fingerprint" else f"said {status}"
            self._failed(why)
            return None
        self.asks += 1
        return value, frames

    def _failed(self, why: str) -> None:
        self.failures += 1
        self._down_until = time.monotonic() + BACKOFF_SECONDS
        log.warning("KV transfer: %s %s: recomputing", self.endpoint, why)

    def close(self) -> None:
        with self._lock:
            if self.socket is not None:
                self.socket.close()
                self.socket = None


def _batches(keys: Sequence[bytes]) -> list[tuple[int, int]]:
    """[lo, hi) slices of `keys` that one ask may carry (MAX_KEYS, KEY_BUDGET bytes)."""
    out: list[tuple[int, int]] = []
    lo = size = 0
    for i, key in enumerate(keys):
        if i - lo == MAX_KEYS or (size + len(key) > KEY_BUDGET and i > lo):
            out.append((lo, i))
            lo, size = i, 0
        size += len(key)
    if lo < len(keys):
        out.append((lo, len(keys)))
    return out
