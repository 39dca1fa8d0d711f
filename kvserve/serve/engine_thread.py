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
from collections.abc import Callable
from typing import Any

from kvserve.engine.llm_engine import LLMEngine
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

log = logging.getLogger("kvserve.serve")

_Stream = tuple[asyncio.AbstractEventLoop, "asyncio.Queue[RequestOutput | BaseException]"]


class EngineThread:
    """Owns the engine; the server talks to it only through `submit`, `abort` and `call`."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
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
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> asyncio.Queue[RequestOutput | BaseException]:
        """Queue a request; its outputs (or the engine's refusal) arrive on the returned queue."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._commands.put(("add", (request_id, prompt, params, (loop, outputs))))
        return outputs

    def abort(self, request_id: str) -> None:
        """Abort from the engine thread (between steps); a finished request is ignored."""
        self._commands.put(("abort", request_id))

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
            while command is not None:
                self._handle(*command)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if self._stopping:
                break
            if self.engine.has_unfinished_requests():
                self._step()

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "add":
            request_id, prompt, params, stream = payload
            try:
                self.engine.add_request(request_id, prompt, params)
            except (ValueError, TypeError) as exc:
                _send(stream, exc)
                return
            self._streams[request_id] = stream
        elif kind == "abort":
            if self._streams.pop(payload, None) is not None:
                self.engine.abort_request(payload)
                self.aborted += 1
                log.info("request %s aborted (client disconnected)", payload)
        elif kind == "call":
            fn, future = payload
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # a broken step fails its requests, not the server
            log.exception("engine step failed")
            for request_id, stream in list(self._streams.items()):
                self.engine.abort_request(request_id)
                _send(stream, RuntimeError(f"engine step failed: {exc}"))
            self._streams.clear()
            return
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
