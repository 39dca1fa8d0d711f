"""Lookups that ask another engine over the network, off the engine thread.

A KV transfer consumer's lookup waits for a producer's answer: a long prompt's blocks
take tens of milliseconds to arrive, and a producer that died costs the whole
`timeout_s`. Run on the engine thread, either would stall every running request's
next token. Here each lookup runs on one background thread; a quick answer (a miss, a
short run) is still used in the step that asked, and otherwise the request waits in
the queue while the others go on, and is admitted at the first step after its blocks
arrived (kvserve.engine.scheduler defers it, as it defers a grammar still compiling).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

PENDING = object()
"""The answer is still on its way."""
QUICK_SECONDS = 0.01
"""How long the engine thread waits for an answer before it goes on without it."""


class Fetches:
    """One background lookup per request, until its answer is taken or forgotten."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvserve-kv-fetch")
        self._futures: dict[str, Future[Any]] = {}

    def result(self, request_id: str, work: Callable[[], Any]) -> Any:
        """`work()`'s result, started now if it was not; PENDING while it runs."""
        future = self._futures.get(request_id)
        if future is None:
            future = self._futures[request_id] = self._pool.submit(work)
            concurrent.futures.wait([future], timeout=QUICK_SECONDS)
        if not future.done():
            return PENDING
        del self._futures[request_id]
        return future.result()

    def forget(self, request_id: str) -> None:
        """The request ended (or was preempted): its answer, when it comes, is dropped."""
        future = self._futures.pop(request_id, None)
        if future is not None:
            future.cancel()

    def wait(self, timeout: float) -> None:
        """Until one answer is in (or `timeout`): an engine with nothing else to do."""
        if self._futures:
            concurrent.futures.wait(
                list(self._futures.values()), timeout, concurrent.futures.FIRST_COMPLETED
            )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
