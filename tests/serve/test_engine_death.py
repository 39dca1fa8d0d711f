"""A dead engine is not a silent one (issue 26): with a fault injected into the engine's
step, the requests in flight get an error at once, /health turns 503 (or the port closes),
and the process exits non-zero so a supervisor restarts it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests._ports import free_port
from tests.serve.conftest import ENGINE, Server, wait_healthy

TRIGGER = 999
"""max_tokens of the request whose presence makes the patched step raise."""
LAUNCH = f"""
import sys
from kvserve.engine.llm_engine import LLMEngine

real = LLMEngine.step

def step(self):
    if any(r.params.max_tokens == {TRIGGER} for r in self.scheduler.running):
        raise MemoryError("injected fault")
    return real(self)

LLMEngine.step = step
from kvserve.cli import main
sys.exit(main())
"""


@pytest.mark.slow
def test_the_engine_thread_dying_fails_everything_and_exits_non_zero(demo):
    port = free_port()
    engine = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCH, "serve", "--model", demo, *engine, "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    server = wait_healthy(Server(f"http://127.0.0.1:{port}", demo, proc))
    try:
        streamed: list[str] = []
        ended = threading.Event()

        def stream() -> None:
            body = {"prompt": "hi", "max_tokens": 1500, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    streamed.append(line)
            ended.set()

        threading.Thread(target=stream, daemon=True).start()
        time.sleep(1.0)
        started = time.monotonic()
        resp = httpx.post(
            f"{server.url}/v1/completions",
            json={"prompt": "boom", "max_tokens": TRIGGER},
            timeout=30,
        )
        assert resp.status_code in (500, 503), resp.text
        assert "engine" in resp.json()["error"]["message"]
        assert ended.wait(10) and time.monotonic() - started < 10
        errors = [json.loads(line[6:]) for line in streamed if line.startswith('data: {"error')]
        assert errors and "engine died" in errors[0]["error"]["message"]
        try:
            health = httpx.get(f"{server.url}/health", timeout=5).status_code
        except httpx.HTTPError:
            health = None  # already gone
        assert health in (503, None)
        assert proc.wait(timeout=30) == 1
        out = proc.stdout.read() if proc.stdout else ""
        assert "the engine died" in out and "injected fault" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
