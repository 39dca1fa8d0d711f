"""The engine's own thread: the only place a step runs, so the event loop never blocks.

Everything that touches the engine (adding, aborting, stepping, the
tokenizer) happens here, in order: the engine is not thread-safe, and a
single owner needs no locks. The thread steps while there is work and sleeps
on its command queue otherwise. Outputs go back to the asyncio queue of their
request through `loop.call_soon_threadsafe`; a request the engine refuses
gets the exception instead, and nothing else is disturbed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvserve.engine.llm_engine import LLMEngine
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.serve.metrics import EngineObserver

log = logging.getLogger("kvserve.serve")

_Stream = tuple[asyncio.AbstractEventLoop, "asyncio.Queue[RequestOutput | BaseException]"]


@dataclass(slots=True)
class Submission:
    """One request as the server hands it to the engine thread (plain data)."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    cache_salt: str | None = None


class RequestRefused(Exception):
    """The engine refused a request (its ValueError's message); names the request."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id


class ServerStopping(Exception):
    """Put on the queues of requests still running when the server's drain time is over."""


class EngineThread:
    """Owns the engine; the server talks to it only through `submit`, `abort` and `call`."""

    def __init__(self, engine: LLMEngine, observer: EngineObserver | None = None) -> None:
        self.engine = engine
        self.observer = observer
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._stopping = False
        self.aborted = 0
        """Requests aborted (client gone); a test and the log read it."""

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._commands.put(("stop", None))
        self._thread.join(timeout)

    def submit(
        self, request: Submission, outputs: asyncio.Queue[RequestOutput | BaseException]
    ) -> None:
        """Queue a request; its outputs (or a RequestRefused) arrive on `outputs`, which
        several requests may share (outputs name their request)."""
        loop = asyncio.get_running_loop()
        self._commands.put(("add", (request, time.monotonic(), (loop, outputs))))

    def abort(self, request_id: str) -> None:
        """Abort from the engine thread (between steps); a finished request is ignored."""
        self._commands.put(("abort", request_id))

    def abort_all(self) -> None:
        """Abort every running request; each stream gets `ServerStopping` (shutdown)."""
        self._commands.put(("abort_all", None))

    def idle(self) -> bool:
        """No request running or about to be added (a drain waits for this)."""
        return not self._streams and self._commands.empty()

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` in the engine thread (tokenizer work) and await its result."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._commands.put(("call", (fn, future)))
        return await asyncio.wrap_future(future)

    # -- the thread ---------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            busy = self.engine.has_unfinished_requests()
            try:
                command = self._commands.get(block=not busy)
            except queue.Empty:
                command = None
            handled = command is not None
            while command is not None:
                self._handle(*command)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if handled and self.observer is not None:
                self.observer.refresh(self.engine)
            if self._stopping:
                break
            if self.engine.has_unfinished_requests():
                self._step()

    def _handle(self, kind: str, payload: Any) -> None:
        observer = self.observer
        if kind == "add":
            request, arrival, stream = payload
            if observer is not None:
                observer.arrived(request.request_id, arrival)
            try:
                self.engine.add_request(
                    request.request_id,
                    request.prompt,
                    request.params,
                    cache_salt=request.cache_salt,
                )
            except (ValueError, TypeError) as exc:
                if observer is not None:
                    observer.refused(request.request_id)
                _send(stream, RequestRefused(request.request_id, str(exc)))
                return
            self._streams[request.request_id] = stream
        elif kind == "abort":
            if self._streams.pop(payload, None) is not None:
                self._abort(payload)
                log.info("request %s aborted (client disconnected)", payload)
        elif kind == "abort_all":
            for request_id, stream in list(self._streams.items()):
                self._abort(request_id)
                _send(stream, ServerStopping("the server is shutting down"))
            self._streams.clear()
        elif kind == "call":
            fn, future = payload
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)

    def _abort(self, request_id: str) -> None:
        n = self.engine.num_completions(request_id)
        self.engine.abort_request(request_id)
        self.aborted += 1
        if self.observer is not None:
            self.observer.aborted(request_id, n)

    def _step(self) -> None:
        started = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as exc:  # a broken step fails its requests, not the server
            log.exception("engine step failed")
            for request_id, failed in list(self._streams.items()):
                self.engine.abort_request(request_id)
                _send(failed, RuntimeError(f"engine step failed: {exc}"))
            self._streams.clear()
            return
        if self.observer is not None:
            self.observer.after_step(self.engine, started, outputs)
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            _send(stream, output)


def _send(stream: _Stream, item: RequestOutput | BaseException) -> None:
    loop, outputs = stream
    with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
        loop.call_soon_threadsafe(outputs.put_nowait, item)
