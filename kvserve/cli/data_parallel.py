"""`kvserve serve --data-parallel-size N`: N engines on one host behind one port.

Each rank is a `kvserve serve` child on a free loopback port with its KV
events on (the --kv-events-config given, else loopback), its ports offset by
its rank as vLLM offsets them (`data_parallel_rank`); a replay socket is
added where none is named, at the event port + N, so the ranks' ports never
meet. The router (kvserve.router, cache-aware) serves the one public
--host/--port. With LoRA adapters every rank loads the same `--lora-modules`,
the router hashes adapter requests with their content identity, and a load or
unload through the port goes to every rank (kvserve.router.adapters). The
children run in a session of their own, so a terminal's Ctrl-C reaches only
the parent: it drains the router, then stops each child with one SIGTERM (each
drains and sends its last events). On Linux a child also gets SIGTERM if the
parent dies. A child that exits while the others start stops them all, with
one line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING

import httpx

from kvserve.cli.common import loopback_events
from kvserve.cli.engine_options import engine_argv
from kvserve.engine.engine_args import EngineArgs
from kvserve.events.config import KVEventsConfig
from kvserve.model.threads import default_num_threads

if TYPE_CHECKING:
    pass

log = logging.getLogger("kvserve.serve")
STOP_GRACE_SECONDS = 10.0
"""Beyond --shutdown-timeout: how long a child may take to close before it is killed."""


def rank_events(config: str | None, size: int) -> list[str]:
    """Each rank's --kv-events-config: events on, a replay socket, ports clear of each other."""
    text = loopback_events(config or '{"enable_kv_cache_events": true}')
    value = json.loads(text)
    cfg = KVEventsConfig.from_any(value)  # a bad key or value: its one-line error
    if not cfg.active:
        log.warning("KV events are off: the router predicts no hits (least load decides)")
    elif cfg.replay_endpoint is None and cfg.endpoint.startswith("tcp://"):
        base, _, port = cfg.endpoint.rpartition(":")
        value["replay_endpoint"] = f"{base}:{int(port) + size}"
    _check_ports(value.get("endpoint", cfg.endpoint), value.get("replay_endpoint"), size)
    first = cfg.data_parallel_rank
    return [json.dumps({**value, "data_parallel_rank": first + r}) for r in range(size)]


def _check_ports(endpoint: str, replay: str | None, size: int) -> None:
    def ports(address: str | None) -> set[int]:
        if not address or not address.startswith("tcp://"):
            return set()
        start = int(address.rpartition(":")[2])
        return set(range(start, start + size))

    if ports(endpoint) & ports(replay):
        raise ValueError(
            f"--data-parallel-size {size}: the event ports {endpoint} and the replay ports "
            f"{replay} overlap once offset by rank; leave {size} ports between them"
        )


def child_argv(
    args: argparse.Namespace, engine_args: EngineArgs, port: int, events: str
) -> list[str]:
    """A rank's `kvserve serve` options: the parent's, on a loopback port, with its events."""
    argv = ["serve", "--host", "127.0.0.1", "--port", str(port)]
    if args.model is not None:
        argv += ["--model", args.model]
    if args.served_model_name:
        argv += ["--served-model-name", args.served_model_name]
    if args.max_queued_requests is not None:
        argv += ["--max-queued-requests", str(args.max_queued_requests)]
    argv += ["--shutdown-timeout", str(args.shutdown_timeout)]
    argv += ["--responses-store-size", str(args.responses_store_size)]
    argv += ["--responses-store-mb", str(args.responses_store_mb)]
    argv += ["--metrics-prefix", args.metrics_prefix]
    if args.log_requests:
        argv.append("--log-requests")
    if args.tool_call_parser:
        argv += ["--tool-call-parser", args.tool_call_parser]
    argv += ["--pooling", args.pooling]
    if args.reasoning_parser is not None:
        argv += ["--reasoning-parser", args.reasoning_parser]
    if getattr(args, "lora_modules", None):  # every rank loads the same adapters
        argv += ["--lora-modules", *(m.to_json() for m in args.lora_modules)]
    return argv + engine_argv(dataclasses.replace(engine_args, kv_events_config=events))


def run_data_parallel(
    args: argparse.Namespace, engine_args: EngineArgs, api_key: str | None
) -> int:
    from kvserve.router import build_router, serve_router

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per health check otherwise
    size = args.data_parallel_size
    if engine_args.num_threads is None:  # the host's cores shared out, not each engine all
        engine_args = dataclasses.replace(engine_args, num_threads=default_num_threads(size))
    events = rank_events(engine_args.kv_events_config, size)
    env = {**os.environ}
    if api_key:
        env["KVSERVE_API_KEY"] = api_key  # never on a command line: `ps` shows those
    children: list[subprocess.Popen] = []
    try:
        urls = []
        for rank in range(size):
            port = _free_port()
            argv = child_argv(args, engine_args, port, events[rank])
            children.append(
                subprocess.Popen(
                    [sys.executable, "-m", "kvserve.cli", *argv],
                    env=env,
                    start_new_session=True,
                    preexec_fn=_die_with_parent,
                )
            )
            urls.append(f"http://127.0.0.1:{port}")
            log.info("data-parallel rank %d: %s", rank, urls[-1])
        _wait_healthy(children, urls)
        state = build_router(urls, "cache-aware", api_key, max_request_bytes=args.max_request_bytes)
        serve_router(state, args.host, args.port, args.shutdown_timeout, args.log_level)
    finally:
        _stop(children, args.shutdown_timeout + STOP_GRACE_SECONDS)
    log.info("stopped")
    return 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (Linux's PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)


def _wait_healthy(children: list[subprocess.Popen], urls: list[str]) -> None:
    waiting = dict(enumerate(urls))
    while waiting:
        for rank, url in list(waiting.items()):
            code = children[rank].poll()
            if code is not None:
                raise ValueError(
                    f"data-parallel rank {rank} exited with code {code} while starting"
                )
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    del waiting[rank]
            except httpx.HTTPError:
                pass
        time.sleep(0.2)


def _stop(children: list[subprocess.Popen], timeout: float) -> None:
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for child in children:
        try:
            child.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
