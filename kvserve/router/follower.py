"""`EventFollower`: one thread follows every replica's KV events and answers hit predictions.

ZMQ sockets belong to one thread, and a replica's view must not change while
a request is matched against it, so one thread owns the subscribers (one per
replica), the `PrefixIndex` and every match. The event loop hands it work on
a queue (attach, detach, predict) and wakes it through a pipe that the same
poller watches.

A prediction must see every batch a replica published before the request
arrived: a follow-up turn is routed right after the answer to the previous
one, whose last step's events may still be on their way. So before it
answers the predictions waiting, the thread asks each replica for its last
sequence number (`kv-last-seq` on the replay socket) and applies the stream
up to it: the replicas are all asked at once, so this costs about one
round trip, shared by every request that arrived meanwhile. The router asks
for that round (`sync`) as a request arrives and tokenizes it meanwhile, so
the round trip and the tokenizer overlap; the match that follows (`predict`
with the round's replicas) waits for nothing. A replica whose last sequence
number went back has restarted: its view is rebuilt from a snapshot.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import zmq

from kvserve.events.index import PrefixIndex
from kvserve.events.subscriber import KVEventSubscriber, ReplayUnavailable

log = logging.getLogger("kvserve.router")
RETRY_SECONDS = 2.0
"""How often a replica whose events could not be followed is tried again."""


@dataclass(slots=True, frozen=True)
class EventSource:
    """Where one replica publishes (endpoints as the router reaches them) and how it hashes."""

    endpoint: str
    replay_endpoint: str
    topic: str
    metadata: dict[str, Any]


Hits = dict[int, int]
"""Replica index -> predicted hit tokens, for every replica whose view is up to date."""


class EventFollower:
    def __init__(self, request_timeout: float = 1.0) -> None:
        self.timeout = request_timeout
        self.index = PrefixIndex()
        self._sources: dict[int, EventSource] = {}
        """The replicas to follow."""
        self._subs: dict[int, KVEventSubscriber] = {}
        self._waiting: dict[int, float] = {}
        """Replicas to follow that have no subscriber yet -> when to try next."""
        self._resyncs: dict[int, int] = {}
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvserve-router-events", daemon=True)

    # -- any thread -------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        if self._closed:
            return
        if self._thread.is_alive():
            self._put("stop", None)
            self._thread.join(5)
        self._closed = True  # no write to the pipe from now on: its numbers may be reused
        os.close(self._wake_r)
        os.close(self._wake_w)

    def attach(self, replica: int, source: EventSource) -> None:
        """Follow a replica from scratch (a fresh view: history replayed, else a snapshot)."""
        self._put("attach", (replica, source))

    def detach(self, replica: int) -> None:
        """Stop following a replica (it is down): its view is dropped."""
        self._put("detach", replica)

    def sync(self) -> concurrent.futures.Future[frozenset[int]]:
        """Bring every view up to date with what its replica published until now; the
        replicas whose view is (the others were slow or down)."""
        future: concurrent.futures.Future[frozenset[int]] = concurrent.futures.Future()
        self._put("sync", future)
        return future

    def predict(
        self,
        prompts: list[list[int]],
        extra_keys: dict[str, str | None],
        synced: frozenset[int] | None = None,
    ) -> concurrent.futures.Future[Hits]:
        """Each up-to-date replica's hit for these prompts (summed). `synced`: the
        replicas a `sync` asked since the request arrived brought up to date; None:
        a sync round first."""
        future: concurrent.futures.Future[Hits] = concurrent.futures.Future()
        self._put("predict", (prompts, extra_keys, synced, future))
        return future

    def stats(self, replica: int) -> tuple[bool, int, int]:
        """(followed, blocks in its view, views rebuilt from a snapshot so far): for /metrics."""
        view = self.index.engines.get(replica)
        sub = self._subs.get(replica)
        resyncs = self._resyncs.get(replica, 0)
        if sub is not None:
            resyncs += sub.resyncs + sub.restarts
        return sub is not None, (view.num_blocks if view is not None else 0), resyncs

    def _put(self, kind: str, payload: Any) -> None:
        self._commands.put((kind, payload))
        if self._closed:
            return
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"!")

    # -- the thread -------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll(1000))
                if self._wake_r in ready:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                work = self._commands_now(poller)
                if work is None:
                    return
                syncs, predictions = work
                self._retry_waiting(poller)
                for replica, sub in list(self._subs.items()):
                    if sub.socket in ready:
                        try:
                            sub.poll()
                        except Exception as exc:
                            self._lost(replica, poller, exc)
                fresh: frozenset[int] | None = None
                if syncs or any(p[2] is None for p in predictions):
                    fresh = self._sync_all(poller)
                    for future in syncs:
                        _settle(future, fresh)
                if predictions:
                    self._answer(predictions, fresh)
        finally:
            for replica in list(self._subs):
                self._drop(replica, poller)

    def _commands_now(self, poller: zmq.Poller) -> tuple[list[Any], list[tuple[Any, ...]]] | None:
        """Apply the attaches and detaches queued, in order; the syncs and predictions
        asked (None: stop)."""
        syncs: list[Any] = []
        predictions: list[tuple[Any, ...]] = []
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return syncs, predictions
            if kind == "stop":
                return None
            if kind == "sync":
                syncs.append(payload)
            elif kind == "predict":
                predictions.append(payload)
            elif kind == "attach":
                replica, source = payload
                self._sources[replica] = source
                self._drop(replica, poller)
                self._waiting[replica] = 0.0
            else:
                self._sources.pop(payload, None)
                self._drop(payload, poller)

    def _retry_waiting(self, poller: zmq.Poller) -> None:
        now = time.monotonic()
        for replica, when in list(self._waiting.items()):
            if when > now:
                continue
            source = self._sources[replica]
            try:
                sub = KVEventSubscriber(
                    source.endpoint,
                    source.replay_endpoint,
                    self.index,
                    engine=replica,
                    topic=source.topic,
                    metadata=source.metadata,
                    request_timeout=self.timeout,
                )
            except Exception as exc:
                self.index.engines.pop(replica, None)
                self._waiting[replica] = now + RETRY_SECONDS
                log.warning("replica %d: cannot follow its KV events yet (%s)", replica, exc)
                continue
            del self._waiting[replica]
            self._subs[replica] = sub
            poller.register(sub.socket, zmq.POLLIN)
            log.info(
                "replica %d: following its KV events (%d blocks)", replica, sub.view.num_blocks
            )

    def _drop(self, replica: int, poller: zmq.Poller) -> None:
        self._waiting.pop(replica, None)
        sub = self._subs.pop(replica, None)
        if sub is not None:
            self._resyncs[replica] = self._resyncs.get(replica, 0) + sub.resyncs + sub.restarts
            poller.unregister(sub.socket)
            sub.close()
        self.index.engines.pop(replica, None)

    def _lost(self, replica: int, poller: zmq.Poller, exc: Exception) -> None:
        """A subscriber that failed midway is not trusted: follow the replica from scratch."""
        log.warning("replica %d: lost its KV events (%s); following it again", replica, exc)
        self._drop(replica, poller)
        self._waiting[replica] = time.monotonic() + RETRY_SECONDS

    def _sync(self, sub: KVEventSubscriber) -> None:
        last = sub.read_last_seq()
        if sub.last_seq is not None and last < sub.last_seq:
            sub.resync()  # the replica restarted: its sequence numbers began again
        if last > (-1 if sub.last_seq is None else sub.last_seq):
            sub.wait_for(last, self.timeout)

    def _sync_all(self, poller: zmq.Poller) -> frozenset[int]:
        """One round: every replica asked its last sequence number before any answer is
        read (the round trips overlap), then each view applied up to it."""
        fresh: list[int] = []
        asked: list[tuple[int, KVEventSubscriber]] = []
        for replica, sub in list(self._subs.items()):
            try:
                sub.ask_last_seq()
            except Exception as exc:
                self._lost(replica, poller, exc)
            else:
                asked.append((replica, sub))
        for replica, sub in asked:
            try:
                self._sync(sub)
            except (ReplayUnavailable, TimeoutError) as exc:  # slow, or down: ask again next time
                log.warning("replica %d: its events are not up to date (%s)", replica, exc)
            except Exception as exc:
                self._lost(replica, poller, exc)
            else:
                fresh.append(replica)
        return frozenset(fresh)

    def _answer(self, predictions: list[tuple[Any, ...]], fresh: frozenset[int] | None) -> None:
        """Match each prompt against the views that are up to date (and still followed)."""
        for prompts, extra_keys, synced, future in predictions:
            replicas = fresh if synced is None else synced
            hits: dict[Hashable, int] = {r: 0 for r in replicas or () if r in self._subs}
            try:
                for tokens in prompts:
                    for replica, n in self.index.match(tokens, extra_keys).items():
                        if replica in hits:
                            hits[replica] += n
            except Exception as exc:
                _settle(future, exc)
            else:
                _settle(future, hits)


def _settle(future: concurrent.futures.Future[Any], outcome: Any) -> None:
    """Answer a caller that is still waiting (one that timed out cancelled its future)."""
    if not future.set_running_or_notify_cancel():
        return
    if isinstance(outcome, Exception):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
