"""The replay socket's answers, sent only as fast as each client reads them.

A replay answer can be the whole replay buffer (10,000 batches by default, hundreds of MB).
Handed to ZMQ at once, it sits in the client's pipe until the client reads it: a client
that asks again and again and never reads grew the server without bound, and the memory
stayed after it left. So the ROUTER socket has a small send high-water mark per client
(`REPLAY_HWM` messages) and ROUTER_MANDATORY, which makes a full pipe an EAGAIN instead of
a silent drop. Each request becomes a `_Reply`: a generator that makes its messages one
at a time (a batch is read from the replay buffer when its turn comes, a snapshot is taken
when it is sent), resumed whenever that client's pipe has room. A client keeps at most
`MAX_PENDING` requests waiting; beyond them a request is refused (counted, logged once).
A client that leaves is forgotten at the next send to it (EHOSTUNREACH), with its replies.

The answers are those of the protocol in publisher.py; a batch replay covers the batches
sent before the request arrived (`end`), from what the buffer still holds when each is
sent: a batch evicted meanwhile is a gap, as a start older than the buffer always was.
"""

from __future__ import annotations

import bisect
import logging
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import zmq

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
SNAPSHOT_REQUEST = b"kv-snapshot"
METADATA_REQUEST = b"kv-metadata"
LAST_SEQ_REQUEST = b"kv-last-seq"

REPLAY_HWM = 64
"""Messages ZMQ holds for one client before a send to it waits (EAGAIN)."""
MAX_PENDING = 8
"""Requests of one client waiting for their answer; more are refused."""
SENDS_PER_CLIENT = 64
"""Messages sent to one client per turn of the sender loop, so no client starves another."""

Message = tuple[bytes, ...]


@dataclass(slots=True)
class _Reply:
    envelope: list[bytes]
    messages: Iterator[Message]
    next: Message | None = None
    """Made, not yet taken by ZMQ (its pipe was full)."""


class ReplayReplies:
    """Per-client queues of replies on a ROUTER socket; one thread (the sender) uses it."""

    def __init__(
        self,
        socket: zmq.Socket,
        buffer: deque[tuple[int, bytes]],
        answer: Callable[[bytes], Message | None],
    ) -> None:
        """`buffer`: (seq, payload) in seq order; `answer`: the single message answering a
        non-batch request (taken when it is sent), None for an unknown request."""
        self._socket = socket
        self._buffer = buffer
        self._answer = answer
        self._clients: OrderedDict[bytes, deque[_Reply]] = OrderedDict()
        self.refused = 0
        """Requests refused because their client had MAX_PENDING waiting."""
        self._warned: set[str] = set()

    @staticmethod
    def configure(socket: zmq.Socket) -> None:
        """Before bind: a bounded pipe per client, and a full pipe reported, not dropped."""
        socket.setsockopt(zmq.SNDHWM, REPLAY_HWM)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)

    @property
    def pending(self) -> int:
        """Requests whose answer is not wholly handed to ZMQ yet."""
        return sum(len(replies) for replies in self._clients.values())

    def add(self, frames: list[bytes], end: int) -> None:
        """A request as received (`[identity, ..., request]`); `end`: the last batch sent."""
        if len(frames) < 2:
            return
        envelope, request = frames[:-1], frames[-1]
        replies = self._clients.setdefault(envelope[0], deque())
        if len(replies) >= MAX_PENDING:
            self.refused += 1
            self._warn_once(
                "refused",
                "KV events: a replay client sent %d requests without reading the answers; "
                "its further requests are refused until it reads",
                MAX_PENDING,
            )
            return
        replies.append(_Reply(envelope, self._messages(request, end)))

    def pump(self) -> None:
        """Hand ZMQ what each client's pipe takes now."""
        for identity in list(self._clients):
            replies = self._clients[identity]
            for _ in range(SENDS_PER_CLIENT):
                if not replies:
                    break
                reply = replies[0]
                if reply.next is None:
                    reply.next = next(reply.messages, None)
                    if reply.next is None:
                        replies.popleft()
                        continue
                try:
                    self._socket.send_multipart([*reply.envelope, *reply.next], zmq.NOBLOCK)
                except zmq.Again:
                    break  # its pipe is full: it is not reading; try at the next turn
                except zmq.ZMQError as exc:
                    if exc.errno != zmq.EHOSTUNREACH:
                        raise
                    replies.clear()  # it left: forget it and everything it asked for
                    break
                reply.next = None
            if not replies:
                del self._clients[identity]

    def _messages(self, request: bytes, end: int) -> Iterator[Message]:
        if len(request) == 8:  # a start seq (the named requests are longer)
            seq = int.from_bytes(request, "big")
            while (item := self._first_from(seq, end)) is not None:
                seq, payload = item
                yield seq.to_bytes(8, "big"), payload
                seq += 1
        else:
            try:
                answer = self._answer(request)
            except Exception:  # the client still gets its end: it does not wait for nothing
                logger.exception("KV events: could not answer replay request %r", request[:32])
                answer = None
            else:
                if answer is None:
                    self._warn_once("unknown", "KV events: unknown replay request %r", request[:32])
            if answer is not None:
                yield answer
        yield END_SEQ, b""

    def _first_from(self, seq: int, end: int) -> tuple[int, bytes] | None:
        """The buffered batch with the smallest seq in [seq, end], if any."""
        buffer = self._buffer
        i = bisect.bisect_left(buffer, seq, key=lambda item: item[0])
        if i < len(buffer) and buffer[i][0] <= end:
            return buffer[i]
        return None

    def _warn_once(self, kind: str, message: str, *args: object) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning(message + " (logged once)", *args)
