"""A real `kvserve serve` process on a free loopback port, started and stopped by the tests."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from kvserve.model.demo import ensure_demo_model
from tests._ports import free_port

ENGINE = {"block_size": 4, "num_threads": 1, "num_kv_blocks": 512}
START_SECONDS = 120


@dataclass
class Server:
    url: str
    model: str
    """The checkpoint path, which is also the served name unless the test set one."""
    proc: subprocess.Popen
    output: deque[str] = field(default_factory=lambda: deque(maxlen=OUTPUT_LINES))
    """What it printed, read as it prints: a pipe nobody reads fills up (64 KiB) and then
    blocks the server's next log line, so a long-lived server stopped answering."""
    reader: threading.Thread | None = None


OUTPUT_LINES = 50_000


def _read_output(server: Server) -> None:
    assert server.proc.stdout is not None
    for line in server.proc.stdout:
        server.output.append(line)


@pytest.fixture(scope="session")
def demo(tmp_path_factory) -> str:
    return ensure_demo_model(tmp_path_factory.mktemp("serve-demo"))


def start_server(
    model: str | None,
    *extra: str,
    env: dict[str, str] | None = None,
    port: int | None = None,
    wait: bool = True,
) -> Server:
    """`model` None serves the default model (no --model); `wait` False: `wait_healthy` later."""
    engine = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    args = ["serve", *(["--model", model] if model is not None else []), *engine, *extra]
    return start_command(args, model or "", env=env, port=port, wait=wait)


def start_command(
    args: list[str],
    model: str = "",
    env: dict[str, str] | None = None,
    port: int | None = None,
    wait: bool = True,
) -> Server:
    """`kvserve ARGS --port PORT` (a free one unless given) with this tree on the path."""
    port = port or free_port()
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # this tree first
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve.cli", *args, "--port", str(port)],
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    server = Server(f"http://127.0.0.1:{port}", model, proc)
    server.reader = threading.Thread(target=_read_output, args=(server,), daemon=True)
    server.reader.start()
    return wait_healthy(server) if wait else server


def wait_healthy(server: Server) -> Server:
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"kvserve {server.proc.args[3]} exited: {printed(server)}")
        try:
            if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_server(server)
    raise RuntimeError(f"kvserve {server.proc.args[3]} did not become healthy in time")


def stop_server(server: Server) -> str:
    """Stop the process (terminate, then kill) and return what it printed."""
    server.proc.terminate()
    try:
        server.proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait(timeout=20)
    return printed(server)


def printed(server: Server) -> str:
    """Everything the server printed (once it exited: up to its last line)."""
    if server.reader is not None and server.proc.poll() is not None:
        server.reader.join(timeout=10)
    return "".join(server.output)


@pytest.fixture(scope="module")
def llm(demo):
    """The same engine settings in process: what the server's answers must equal."""
    from kvserve import LLM

    engine = LLM(demo, **ENGINE)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    """The official OpenAI client on the shared server."""
    import openai

    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=60) as c:
        yield c


@pytest.fixture(scope="session")
def server(demo) -> Iterator[Server]:
    """One server shared by the tests that need no special flags (each start costs seconds)."""
    srv = start_server(demo)
    yield srv
    stop_server(srv)


@pytest.fixture(scope="session")
def tool_server(demo, tmp_path_factory) -> Iterator[Server]:
    """A server on the demo checkpoint with a template that renders tools (hermes markers)."""
    from _tool_checkpoint import TOOL_MODEL, tool_checkpoint

    path = tool_checkpoint(demo, tmp_path_factory.mktemp("tools"))
    srv = start_server(path, "--served-model-name", TOOL_MODEL)
    yield srv
    stop_server(srv)


def scrape(server: Server, prefix: str = "kvserve") -> dict[str, float]:
    """/metrics as {'name{labels}': value}, for the series with `prefix`."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(f"{prefix}:"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                values[f"{sample.name}{{{labels}}}"] = sample.value
    return values


def metric(values: dict[str, float], name: str, **labels: str) -> float:
    """One series' value; `model_name` need not be given."""
    for key, value in values.items():
        series, _, rest = key.partition("{")
        pairs = dict(p.split("=", 1) for p in rest.rstrip("}").split(",") if p)
        if series == name and all(pairs.get(k) == v for k, v in labels.items()):
            return value
    raise KeyError(f"{name} {labels} not in /metrics: {sorted(values)[:50]}")
