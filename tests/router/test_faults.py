"""What the router does with replicas that fail: a retry before the first byte, a refusal
to start over replicas that disagree, and the API key."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.router._standin import StandIn
from tests.router.conftest import router_value, start_replicas, start_router, stop_all


@pytest.fixture(scope="module")
def replica(demo):
    (server,) = start_replicas(demo, 1)
    yield server
    stop_all(server)


def kv_metadata(replica) -> dict:
    return httpx.get(f"{replica.url}/kv-metadata", timeout=10).json()


@pytest.mark.slow
def test_a_request_dropped_before_its_first_byte_is_sent_again_elsewhere(replica):
    broken = StandIn({**kv_metadata(replica), "kv_events": None})
    router = None
    try:
        router = start_router([broken, replica], "--policy", "round-robin", "--api-key", "k")
        url = f"{router.url}/v1/completions"
        assert httpx.post(url, json={"prompt": "hi"}).status_code == 401
        key = {"Authorization": "Bearer k"}
        for i in range(4):
            body = {"prompt": f"request {i}", "max_tokens": 2}
            resp = httpx.post(url, json=body, headers=key, timeout=60)
            assert resp.status_code == 200, resp.text
        assert broken.dropped >= 1
        assert router_value(router, "retries_total", broken.url) == broken.dropped
        assert router_value(router, "requests_total", replica) == 4
        assert httpx.get(f"{router.url}/health").status_code == 200  # open, as on replicas
    finally:
        stop_all(router)
        broken.close()


def test_replicas_that_disagree_refuse_to_start(replica):
    other = StandIn({**kv_metadata(replica), "model": "/elsewhere/another-model"})
    try:
        cmd = [sys.executable, "-m", "kvserve.cli", "route", "--port", "0"]
        cmd += ["--replica", replica.url, "--replica", other.url]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    finally:
        other.close()
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr
    assert "disagree on the model" in lines[0] and "/elsewhere/another-model" in lines[0]
