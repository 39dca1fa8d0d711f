"""`KVEventSubscriber`: follows one engine's stream into a `PrefixIndex`, never silently wrong.

Every batch carries a sequence number. The subscriber applies batch `n` only
right after `n - 1`; on a gap it asks the replay socket for the missing
batches, and when the replay buffer no longer has them (or the publisher
dropped them) it asks for a snapshot and rebuilds the engine's view from it.
A fresh subscriber starts from a snapshot too (or from batch 0, which needs
no history). A sequence number going back to 0 means the engine restarted.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Hashable
from typing import Any

import zmq

from kvserve.events.index import PrefixIndex
from kvserve.events.replay import (
    END_SEQ,
    LAST_SEQ_REQUEST,
    METADATA_REQUEST,
    SNAPSHOT_REQUEST,
)
from kvserve.kvcache.events import KVEventBatch, decode_batch


class ReplayUnavailable(RuntimeError):
    """The publisher did not answer on its replay socket in time."""


class KVEventSubscriber:
    """SUB socket for the live stream, DEALER for replay, snapshot and metadata."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        index: PrefixIndex | None = None,
        *,
        engine: Hashable | None = None,
        topic: str = "",
        metadata: dict[str, Any] | None = None,
        request_timeout: float = 5.0,
        on_batch: Callable[[int, KVEventBatch], None] | None = None,
        sync: bool = True,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.engine = engine if engine is not None else endpoint
        self.index = index if index is not None else PrefixIndex()
        self.request_timeout = request_timeout
        self.on_batch = on_batch
        self.last_seq: int | None = None
        """Last batch applied (None: nothing known yet)."""
        self.gaps = self.replays = self.resyncs = self.restarts = 0
        self._first_ts: float | None = None
        """ts of batch 0 as applied: a later batch 0 with another ts means a restart."""
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._dealer: zmq.Socket | None = None
        if replay_endpoint:
            self._dealer = ctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.connect(replay_endpoint)
        try:
            if metadata is None:
                metadata = self.fetch_metadata()
            self.view = self.index.add_engine(self.engine, metadata)
            if sync and self._dealer is not None:
                self.catch_up()  # history from batch 0 if still buffered, else a snapshot
        except BaseException:
            self.close()  # a watcher retries every second: no sockets left behind
            raise

    @property
    def socket(self) -> zmq.Socket:
        """The SUB socket: a caller following several engines in one thread polls them all."""
        return self._sub

    # -- requests on the replay socket -----------------------------------------

    def _request(self, request: bytes) -> list[list[bytes]]:
        """Send one request; the reply's messages (frames after the delimiter) up to END."""
        self._send(request)
        return self._reply()

    def _send(self, request: bytes) -> None:
        if self._dealer is None:
            raise ReplayUnavailable("no replay endpoint configured")
        self._dealer.send_multipart([b"", request])

    def _reply(self) -> list[list[bytes]]:
        """The messages answering the request sent last, up to END (within the timeout)."""
        assert self._dealer is not None
        out: list[list[bytes]] = []
        deadline = time.monotonic() + self.request_timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._dealer.poll(int(remaining * 1000)):
                # Re-create the socket so a late reply cannot be read as the next answer.
                self._dealer.close(linger=0)
                self._dealer = zmq.Context.instance().socket(zmq.DEALER)
                self._dealer.setsockopt(zmq.LINGER, 0)
                self._dealer.connect(self.replay_endpoint)
                raise ReplayUnavailable(f"no reply from {self.replay_endpoint}")
            frames = self._dealer.recv_multipart()[1:]
            if frames[0] == END_SEQ:
                return out
            out.append(frames)

    def fetch_metadata(self) -> dict[str, Any]:
        """The engine's hashing and group metadata (from its replay socket)."""
        (reply,) = self._request(METADATA_REQUEST)
        return json.loads(reply[1])

    def resync(self) -> int:
        """Rebuild this engine's view from a snapshot; returns the seq it is valid after."""
        (reply,) = self._request(SNAPSHOT_REQUEST)
        seq = int.from_bytes(reply[1], "big", signed=True)
        self.view.clear()
        self._apply(seq, decode_batch(reply[2]))
        self.resyncs += 1
        return seq

    @property
    def next_seq(self) -> int:
        return 0 if self.last_seq is None else self.last_seq + 1

    def replay(self) -> str:
        """Apply buffered batches from `next_seq` on.

        Returns "ok" (some applied, no hole), "empty" (nothing buffered from
        there) or "hole" (the buffer lacks a batch we need: resync).
        """
        messages = self._request(self.next_seq.to_bytes(8, "big"))
        self.replays += 1
        if not messages:
            return "empty"
        for seq_bytes, payload in messages:
            seq = int.from_bytes(seq_bytes, "big")
            if seq < self.next_seq:
                continue
            if seq != self.next_seq:
                return "hole"
            self._apply(seq, decode_batch(payload))
        return "ok"

    def publisher_last_seq(self) -> int:
        """The last seq the publisher assigned (published or dropped); -1 before any."""
        self.ask_last_seq()
        return self.read_last_seq()

    def ask_last_seq(self) -> None:
        """Send `kv-last-seq` without waiting: a caller following several engines asks
        them all, then reads each answer (`read_last_seq`), paying one round trip, not N."""
        self._send(LAST_SEQ_REQUEST)

    def read_last_seq(self) -> int:
        """The answer to `ask_last_seq`."""
        (reply,) = self._reply()
        return int.from_bytes(reply[1], "big", signed=True)

    def catch_up(self) -> None:
        """Fetch whatever follows the last applied batch: replay, else a snapshot.

        PUB/SUB may lose the newest batches (a slow joiner, a dropped batch
        with nothing after it); this is how a quiet stream is verified.
        """
        state = self.replay()
        if state == "hole":
            self.resync()
        elif state == "empty":
            last = -1 if self.last_seq is None else self.last_seq
            if self.last_seq is None or self.publisher_last_seq() > last:
                self.resync()

    # -- the live stream ---------------------------------------------------------

    def poll(self, timeout: float = 0.0) -> int:
        """Handle every batch that arrives within `timeout` seconds; returns how many."""
        handled = 0
        wait_ms = int(timeout * 1000)
        while self._sub.poll(wait_ms):
            _topic, seq_bytes, payload = self._sub.recv_multipart()
            self._on_message(int.from_bytes(seq_bytes, "big"), payload)
            handled += 1
            wait_ms = 0
        return handled

    def wait_for(self, seq: int, timeout: float = 5.0) -> None:
        """Poll until batch `seq` is applied; catch up on the replay socket if the stream stalls."""
        deadline = time.monotonic() + timeout
        while self.last_seq is None or self.last_seq < seq:
            if time.monotonic() > deadline:
                raise TimeoutError(f"batch {seq} not applied (last {self.last_seq})")
            if not self.poll(0.05) and (self.last_seq is None or self.last_seq < seq):
                self.catch_up()

    def _on_message(self, seq: int, payload: bytes) -> None:
        last = self.last_seq
        if last is not None and seq <= last:
            if seq == 0:
                batch = decode_batch(payload)
                if batch.ts != self._first_ts:  # not a late copy: the engine restarted
                    self.restarts += 1
                    self.view.clear()
                    self._apply(seq, batch)
            return
        expected = 0 if last is None else last + 1
        if seq == expected:
            self._apply(seq, decode_batch(payload))
            return
        self.gaps += 1
        if self._dealer is None:
            raise ReplayUnavailable(f"gap before batch {seq} and no replay endpoint to recover")
        if self.replay() != "ok":
            self.resync()
            if seq > self.next_seq:
                self.replay()  # the batches between the snapshot and this one
        if seq == self.next_seq:
            self._apply(seq, decode_batch(payload))

    def _apply(self, seq: int, batch: KVEventBatch) -> None:
        if seq == 0:
            self._first_ts = batch.ts
        self.view.apply(batch)
        self.last_seq = seq
        if self.on_batch is not None:
            self.on_batch(seq, batch)

    def close(self) -> None:
        self._sub.close(linger=0)
        if self._dealer is not None:
            self._dealer.close(linger=0)
