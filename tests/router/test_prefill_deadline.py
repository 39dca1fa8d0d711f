"""`kvserve route --prefill P --decode D --prefill-timeout S`: a prefill engine that takes
the request and never answers (a stand-in stuck mid-request, its /health still 200) costs
each request S seconds, no more: the router leaves the call (closing its connection, which
aborts the request on a real engine), the decode engine computes the prompt itself and
answers as one engine alone, and the router counts the fallback."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.router._standin import StandIn
from tests.router.conftest import start_replicas, stop_all, wait_for
from tests.serve.conftest import metric, scrape, start_command

LONG = "Tell me about the sea and the ships on it. " * 4  # over --prefill-min-tokens


def chat(url: str, content: str, stream: bool = False) -> str:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 8,
            "temperature": 0, "stream": stream}  # fmt: skip
    resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=100)
    assert resp.status_code == 200, resp.text
    if not stream:
        return resp.json()["choices"][0]["message"]["content"]
    return "".join(
        httpx.Response(200, content=line[6:]).json()["choices"][0]["delta"].get("content") or ""
        for line in resp.text.splitlines()
        if line.startswith("data: {")
    )


@pytest.mark.slow  # a replica and a router started: about 20 s on 2 cores
def test_a_prefill_engine_that_hangs_costs_each_request_its_deadline_only(demo):
    (decode,) = start_replicas(demo, 1)
    info = httpx.get(f"{decode.url}/kv-metadata", timeout=10).json()
    stuck = StandIn({**info, "kv_events": None}, hang=True)
    router = None
    try:
        route = ["route", "--prefill", stuck.url, "--decode", decode.url]
        router = start_command([*route, "--prefill-min-tokens", "16", "--prefill-timeout", "1"],
                               demo)  # fmt: skip
        prompts = [f"{i}: {LONG}" for i in range(3)]
        t0 = time.monotonic()
        with ThreadPoolExecutor(3) as pool:  # at once, one of them streamed
            got = list(pool.map(lambda i: chat(router.url, prompts[i], i == 2), range(3)))
        assert time.monotonic() - t0 < 60  # liveness: the stand-in would hold them 120 s
        assert got == [chat(decode.url, p) for p in prompts]
        assert stuck.hanging == 3
        wait_for(lambda: stuck.abandoned == 3, 30, "the router to leave the stuck prefills")
        fallbacks = "kvserve:router_prefill_fallbacks_total"
        values = scrape(router)
        assert metric(values, fallbacks, replica=stuck.url, reason="timeout") == 3
        assert metric(values, fallbacks, replica=stuck.url, reason="failed") == 0
    finally:
        stop_all(router, decode)
        stuck.close()


def test_a_prefill_timeout_out_of_range_is_refused_in_one_line():
    cmd = [sys.executable, "-m", "kvserve.cli", "route", "--port", "0", "--prefill-timeout",
           "0", "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr
    assert "--prefill-timeout must be in (0, 3600]" in lines[0]
