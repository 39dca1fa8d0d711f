"""`ZmqEventPublisher`: vLLM's wire protocol, but `publish` never blocks the engine.

PUB socket: three frames `[topic, seq (u64 big-endian), payload]`. ROUTER
replay socket; a request is one frame after the envelope:

- 8 bytes: a start seq. Reply: every buffered batch from it as `[seq, payload]`,
  then `[seq -1, b""]` (vLLM's protocol).
- `b"kv-snapshot"`: resync. Reply `[b"kv-snapshot", seq, payload]` (a batch of
  everything cached, valid after batch `seq`; seq -1: before the first), then
  seq -1.
- `b"kv-metadata"`: reply `[b"kv-metadata", json]`, then seq -1.
- `b"kv-last-seq"`: reply `[b"kv-last-seq", seq]` (the last seq assigned, sent
  or dropped), then seq -1: a subscriber whose newest batches were dropped
  learns it has to resync.

Answers go out only as fast as each client reads them, a few requests per client at a
time (replay.py): a client that asks and never reads costs a bounded amount of memory.

The engine thread only assigns the sequence number and puts the batch in a
bounded queue; a background thread encodes and sends (and sends what is
queued before it answers a replay request: a replay covers every batch
published before it was asked). A full queue drops the
batch and counts it: the gap in sequence numbers tells subscribers, who
replay or resync.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from kvserve.events.config import KVEventsConfig, offset_endpoint_port
from kvserve.events.replay import (
    LAST_SEQ_REQUEST,
    METADATA_REQUEST,
    SNAPSHOT_REQUEST,
    Message,
    ReplayReplies,
)
from kvserve.kvcache.events import KVEvent, KVEventBatch, encode_batch

logger = logging.getLogger(__name__)

MAX_REQUESTS_PER_TURN = 64
"""Replay requests read per turn of the sender loop: a flood of them never starves PUB."""

SnapshotFn = Callable[[], tuple[int, list[KVEvent]]]
"""Returns (seq the snapshot is valid after, its events); called on the sender thread."""


def should_bind(endpoint: str) -> bool:
    """vLLM's rule: a wildcard (or a local transport) binds; anything else connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _bound(socket: zmq.Socket, endpoint: str) -> str:
    """`tcp://HOST:*` (any free port, as ZMQ binds it) -> the port it got, so the endpoint
    reported is one a subscriber can reach; any other endpoint stays as written."""
    if not endpoint.startswith("tcp://") or not endpoint.endswith(":*"):
        return endpoint
    return str(socket.getsockopt_string(zmq.LAST_ENDPOINT))


class ZmqEventPublisher:
    """PUB + ROUTER publisher with a bounded queue and a bounded replay buffer."""

    POLL_SECONDS = 0.005
    """How long the sender waits for a batch while work is about (replays are read in between)."""
    IDLE_POLL_SECONDS = 0.05
    """The wait once a second has passed with nothing to send or answer: a batch still wakes
    the sender at once (the queue), only a replay request waits up to this long. An idle
    engine's sender then wakes 20 times a second, not 200 (a server idles most of its life)."""

    def __init__(
        self,
        config: KVEventsConfig,
        snapshot_fn: SnapshotFn | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        self.config = config
        self.data_parallel_rank = config.data_parallel_rank
        self.endpoint = offset_endpoint_port(config.endpoint, self.data_parallel_rank)
        self.replay_endpoint = offset_endpoint_port(config.replay_endpoint, self.data_parallel_rank)
        self._snapshot_fn = snapshot_fn
        self._metadata = json.dumps(metadata or {}).encode()
        self._topic = config.topic.encode()
        self._queue: queue.Queue[tuple[int, KVEventBatch]] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self.dropped = 0
        """Batches dropped because the queue was full (their seqs are gaps)."""
        self.sent = 0
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket | None = None
        self._replies: ReplayReplies | None = None
        try:
            bind = config.bind if config.bind is not None else should_bind(self.endpoint)
            if bind:
                self._pub.bind(self.endpoint)
                self.endpoint = _bound(self._pub, self.endpoint)
            else:
                self._pub.connect(self.endpoint)
            if self.replay_endpoint:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                ReplayReplies.configure(self._replay)
                self._replay.bind(self.replay_endpoint)
                self.replay_endpoint = _bound(self._replay, self.replay_endpoint)
                self._replies = ReplayReplies(self._replay, self._buffer, self._answer)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise OSError(
                f"KV events: cannot open {self.endpoint} / {self.replay_endpoint}: {exc}"
            ) from None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()

    # -- engine thread ----------------------------------------------------------

    @property
    def last_seq(self) -> int:
        """Sequence number of the last batch published (or dropped); -1 before any."""
        return self._next_seq - 1

    def publish(self, events: list[KVEvent] | KVEventBatch) -> int:
        """Queue one step's events; returns their seq. Never blocks: a full queue drops."""
        if isinstance(events, KVEventBatch):
            batch = events
            if batch.data_parallel_rank is None:
                batch.data_parallel_rank = self.data_parallel_rank
        else:
            batch = KVEventBatch(time.time(), events, self.data_parallel_rank)
        seq = self._next_seq
        self._next_seq = seq + 1
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self.dropped += 1
        return seq

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (up to `timeout`), then close the sockets."""
        if self._stop.is_set():
            return
        deadline = time.monotonic() + timeout
        while not self._queue.empty() and time.monotonic() < deadline:
            time.sleep(0.002)
        self._stop.set()
        self._thread.join(timeout=timeout)
        # Linger: what the sender handed to ZMQ still reaches connected subscribers.
        self._close_sockets(linger_ms=int(timeout * 1000))

    def _close_sockets(self, linger_ms: int = 0) -> None:
        self._pub.close(linger=linger_ms)
        if self._replay is not None:
            self._replay.close(linger=0)

    # -- sender thread ----------------------------------------------------------

    def _run(self) -> None:
        get = self._queue.get
        idle_polls_before_slowing = round(1.0 / self.POLL_SECONDS)
        idle = 0
        while not self._stop.is_set():
            wait = (
                self.IDLE_POLL_SECONDS if idle >= idle_polls_before_slowing else self.POLL_SECONDS
            )
            try:
                seq, batch = get(timeout=wait)
            except queue.Empty:
                idle += 1
            else:
                idle = 0
                try:
                    self._send(seq, encode_batch(batch))
                except Exception:  # never let one bad batch stop the stream
                    logger.exception("KV events: could not send batch %d", seq)
            if self._serve_replays():
                idle = 0

    def _serve_replays(self) -> bool:
        """Read the waiting replay requests (a bounded number), then send what fits; whether
        any replay work was (or still is) about."""
        replay, replies = self._replay, self._replies
        if replay is None or replies is None:
            return False
        busy = replies.pending > 0
        for _ in range(MAX_REQUESTS_PER_TURN):
            if not replay.poll(0):
                break
            busy = True
            try:
                frames = replay.recv_multipart(zmq.NOBLOCK)
                self._drain()  # the answer covers every batch published before the request
                replies.add(frames, self._buffer[-1][0] if self._buffer else -1)
            except Exception:
                logger.exception("KV events: bad replay request")
        try:
            replies.pump()
        except Exception:
            logger.exception("KV events: could not send a replay answer")
        return busy

    def _drain(self) -> None:
        """Send every queued batch, so a replay answers with all published before it."""
        while True:
            try:
                seq, batch = self._queue.get_nowait()
            except queue.Empty:
                return
            try:
                self._send(seq, encode_batch(batch))
            except Exception:
                logger.exception("KV events: could not send batch %d", seq)

    def _send(self, seq: int, payload: bytes) -> None:
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
            self.sent += 1
        except zmq.Again:
            pass

    def _answer(self, request: bytes) -> Message | None:
        """The one message answering a named request (taken when it is sent); None: unknown."""
        if request == SNAPSHOT_REQUEST and self._snapshot_fn is not None:
            seq, events = self._snapshot_fn()
            batch = KVEventBatch(time.time(), events, self.data_parallel_rank)
            return SNAPSHOT_REQUEST, seq.to_bytes(8, "big", signed=True), encode_batch(batch)
        if request == METADATA_REQUEST:
            return METADATA_REQUEST, self._metadata
        if request == LAST_SEQ_REQUEST:
            return LAST_SEQ_REQUEST, self.last_seq.to_bytes(8, "big", signed=True)
        return None
