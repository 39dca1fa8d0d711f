"""The engine's own thread: the only place a step runs, so the event loop never blocks.

Everything that touches the engine (adding, aborting, stepping) happens
here, in order: the engine is not thread-safe, and a single owner needs no
locks. Prompts arrive as token ids (the tokenizer has its own worker thread,
tokenizer_worker.py; the engine thread only decodes output text). The
thread steps while there is work and sleeps on its command queue otherwise.
Outputs go back to the asyncio queue of their request through
`loop.call_soon_threadsafe`; a request the engine refuses gets the exception
instead, and nothing else is disturbed.

If the thread dies (an exception outside a request's own work: a step that
fails as a whole leaves the engine's state unknown), every request running or
queued gets `EngineDead` at once, later submissions get it straight away, and
`on_death` tells the server, which turns /health 503 and exits non-zero so a
supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvserve.engine.llm_engine import LLMEngine
from kvserve.lora.request import Adapter, LoRARequest
from kvserve.model.threads import release_openmp_pool
from kvserve.outputs import RequestOutput
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import SamplingParams
from kvserve.serve.http.metrics import EngineObserver

log = logging.getLogger("kvserve.serve")

_Stream = tuple[asyncio.AbstractEventLoop, "asyncio.Queue[RequestOutput | BaseException]"]


@dataclass(slots=True)
class Submission:
    """One request as the server hands it to the engine thread (plain data)."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams | PoolingParams
    cache_salt: str | None = None
    client_id: str | None = None
    """The client request it is part of (a batch's prompts share one): the engine admits
    round-robin between client requests. None: the request itself."""
    priority: int = 0
    lora: LoRARequest | None = None
    """The LoRA adapter the request's `model` named; None: the base model."""


def freeze_heap() -> None:
    """Exempt what start-up allocated (the model's modules, the tokenizer, the app and its
    schemas) from Python's cyclic garbage collector, once a server process is ready.

    A full collection walks every tracked object with the GIL held, and the engine thread
    waits for it: with the default model served, start-up leaves about 340,000 objects,
    and each full collection during start-up took up to 165 ms. Frozen, they are skipped
    (a later full collection: about 1 ms; vLLM's engine core freezes its heap too). Only
    for a process that serves one engine for its life: frozen objects that later become
    cyclic garbage are never collected.
    """
    gc.collect()
    gc.freeze()
    log.info("start-up heap frozen: %d objects skipped by the garbage collector",
             gc.get_freeze_count())  # fmt: skip


class RequestRefused(Exception):
    """The engine refused a request (its ValueError's message); names the request."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id


class ServerStopping(Exception):
    """Put on the queues of requests still running when the server's drain time is over."""


class EngineDead(RuntimeError):
    """The engine thread died: what every request running, queued or new gets."""


class EngineThread:
    """Owns the engine; the server talks to it only through `submit` and `abort`."""

    def __init__(
        self,
        engine: LLMEngine,
        observer: EngineObserver | None = None,
        on_death: Callable[[str], None] | None = None,
    ) -> None:
        self.engine = engine
        self.on_death = on_death
        """Called (on the engine thread) with the reason when the thread dies."""
        self.dead: str | None = None
        """Why the engine thread died; None while it lives."""
        self.observer = observer
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._stopping = False
        self.aborted = 0
        """Requests aborted (client gone); a test and the log read it."""

    def start(self) -> None:
        """Start stepping; the calling thread, which built the engine, gives up its OpenMP
        workers (kvserve.model.threads.release_openmp_pool says why)."""
        self._thread.start()
        release_openmp_pool()

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
        if self.dead is not None:
            outputs.put_nowait(EngineDead(f"the engine is dead ({self.dead})"))
            return
        self._commands.put(("add", (request, time.monotonic(), (loop, outputs))))
        if self.dead is not None:  # it died while this was queued: nobody will take it
            self._fail_commands()

    def abort(self, request_id: str) -> None:
        """Abort from the engine thread (between steps); a finished request is ignored."""
        self._commands.put(("abort", request_id))

    def abort_many(self, name: str, request_ids: list[str]) -> None:
        """Abort the engine requests of one client request (a batch's prompts or inputs)
        in one command, logged as one line under `name`."""
        self._commands.put(("abort_many", (name, request_ids)))

    def load_adapter(self, request: LoRARequest) -> asyncio.Future[Adapter]:
        """Resolve an adapter on the engine thread (its files read, its weights checked and
        kept loaded): its Adapter, or the ValueError naming what is wrong."""
        future: concurrent.futures.Future[Adapter] = concurrent.futures.Future()
        if self.dead is not None:
            future.set_exception(EngineDead(f"the engine is dead ({self.dead})"))
        else:
            self._commands.put(("load_lora", (request, future)))
            if self.dead is not None:
                self._fail_commands()
        return asyncio.wrap_future(future)

    def forget_adapter(self, name: str) -> None:
        """Drop what the engine remembers of an unloaded name (running requests keep theirs)."""
        self._commands.put(("forget_lora", name))

    def abort_all(self) -> None:
        """Abort every running request; each stream gets `ServerStopping` (shutdown)."""
        self._commands.put(("abort_all", None))

    def idle(self) -> bool:
        """No request running or about to be added (a drain waits for this)."""
        return not self._streams and self._commands.empty()

    # -- the thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:
            log.critical("the engine thread died", exc_info=exc)
            self._die(f"{type(exc).__name__}: {exc}"[:300])

    def _die(self, reason: str) -> None:
        """Fail everything running or queued, refuse what comes, tell the server."""
        self.dead = reason
        error = f"the engine died ({reason}); the server is restarting"
        for stream in self._streams.values():
            _send(stream, EngineDead(error))
        self._streams.clear()
        self._fail_commands()
        if self.on_death is not None:
            self.on_death(reason)

    def _fail_commands(self) -> None:
        """Answer every queued command with EngineDead (any thread may call it)."""
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            error = EngineDead(f"the engine is dead ({self.dead})")
            if kind == "add":
                _send(payload[2], error)
            elif kind == "load_lora" and not payload[1].done():
                payload[1].set_exception(error)

    def _loop(self) -> None:
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
                    client_id=request.client_id,
                    priority=request.priority,
                    lora_request=request.lora,
                )
            except (ValueError, TypeError) as exc:
                if observer is not None:
                    observer.refused(request.request_id)
                _send(stream, RequestRefused(request.request_id, str(exc)))
                return
            except Exception as exc:  # a bug in adding this one request: it alone fails
                log.exception("request %s could not be added", request.request_id)
                _send(stream, RuntimeError(f"internal error: {type(exc).__name__}"))
                return
            self._streams[request.request_id] = stream
        elif kind == "abort":
            if self._streams.pop(payload, None) is not None:
                self._abort(payload)
                log.info("request %s aborted (client disconnected)", payload)
        elif kind == "abort_many":
            name, request_ids = payload
            gone = [rid for rid in request_ids if self._streams.pop(rid, None) is not None]
            for request_id in gone:
                self._abort(request_id)
            if gone:
                count = "" if len(request_ids) == 1 else f": {len(gone)} engine requests"
                log.info("request %s aborted (client disconnected)%s", name, count)
        elif kind == "load_lora":
            self._load_adapter(*payload)
        elif kind == "forget_lora" and self.engine.loras is not None:
            self.engine.loras.forget(payload)
        elif kind == "abort_all":
            for request_id, stream in list(self._streams.items()):
                self._abort(request_id)
                _send(stream, ServerStopping("the server is shutting down"))
            self._streams.clear()

    def _load_adapter(self, request: LoRARequest, future: concurrent.futures.Future[Any]) -> None:
        """A bad adapter fails its load alone (a ValueError), as a bad request fails alone."""
        loras = self.engine.loras
        try:
            if loras is None:
                raise ValueError("this engine has no LoRA adapters (--enable-lora)")
            future.set_result(loras.resolve(request))
        except (ValueError, OSError) as exc:
            future.set_exception(ValueError(str(exc)))
        except Exception as exc:  # a bug in loading this one adapter: it alone fails
            log.exception("LoRA adapter %s could not be loaded", request.lora_name)
            future.set_exception(RuntimeError(f"internal error: {type(exc).__name__}"))

    def _abort(self, request_id: str) -> None:
        n = self.engine.num_completions(request_id)
        self.engine.abort_request(request_id)
        self.aborted += 1
        if self.observer is not None:
            self.observer.aborted(request_id, n)

    def _step(self) -> None:
        # A step that raises (not one request's fault: the engine fails those alone)
        # leaves the engine half way through it: the thread dies (`_run`).
        started = time.monotonic()
        outputs = self.engine.step()
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
