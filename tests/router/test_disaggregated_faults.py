"""`kvserve route --prefill P --decode A --decode B` under load, decode engine A killed
while it holds requests it has not answered a byte of (non-streamed): the router sends
each of them again to B, which pulls the prompt's blocks from P and answers with the
same greedy text (tokens) as one engine alone. Nothing is lost, and every surviving engine
ends with no KV block in use. For full attention (the demo model, chats), sliding windows
(Gemma 3) and a Mamba2 hybrid (Bamba), these two by token ids (their tiny checkpoints
have no tokenizer)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.router.conftest import (
    router_value,
    start_split_replicas,
    stop_all,
    wait_for,
)
from tests.serve.conftest import metric, scrape, start_command, wait_healthy

pytestmark = pytest.mark.slow

LONG = "Tell me about the sea and the ships on it. " * 8
N = 6


def chat(url: str, i: int) -> tuple[int, Any]:
    body = {"messages": [{"role": "user", "content": f"{i}: {LONG}"}], "max_tokens": 256,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    if resp.status_code != 200:
        return resp.status_code, resp.text
    return 200, resp.json()["choices"][0]["message"]["content"]


def complete(url: str, i: int) -> tuple[int, Any]:
    """A prompt of token ids; the answer's tokens (as its logprobs name them)."""
    prompt = [3 + (7 * i + j) % 250 for j in range(60)]
    body = {"prompt": prompt, "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}  # fmt: skip
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    if resp.status_code != 200:
        return resp.status_code, resp.text
    return 200, resp.json()["choices"][0]["logprobs"]["tokens"]


@pytest.fixture(params=["demo", "gemma3", "bamba"])
def kind(request) -> tuple[str, Any]:
    """(the checkpoint, how a request is asked of it)."""
    if request.param == "demo":
        return request.getfixturevalue("demo"), chat
    return request.getfixturevalue(f"{request.param}_checkpoint").path, complete


def test_a_decode_engine_killed_before_its_first_byte_loses_no_request(kind):
    model, ask = kind
    started = start_split_replicas(model, decoders=2)
    router = None
    try:
        prefill, a, b = [wait_healthy(s) for s in started]
        with ThreadPoolExecutor(N) as pool:  # one engine, the whole request
            want = list(pool.map(lambda i: ask(prefill.url, i), range(N)))
        route = ["route", "--prefill", prefill.url, "--decode", a.url, "--decode", b.url]
        # Round robin: A surely gets requests (each long enough to be seen running).
        router = start_command([*route, "--prefill-min-tokens", "16", "--policy", "round-robin"],
                               model)  # fmt: skip

        def running(server) -> float:
            return metric(scrape(server), "kvserve:num_requests_running")

        with ThreadPoolExecutor(N) as pool:
            answers = [pool.submit(ask, router.url, i) for i in range(N)]
            wait_for(lambda: running(a) > 0, 120, "a request running on decode engine A")
            a.proc.kill()
            a.proc.wait()
            got = [f.result() for f in answers]
        assert got == want
        assert router_value(router, "retries_total", a) >= 1  # A's requests went to B
        for server in (prefill, b):
            wait_for(lambda s=server: running(s) == 0, 120, "the engines idle")
            assert metric(scrape(server), "kvserve:kv_cache_usage_perc") == 0
        assert metric(scrape(b), "kvserve:kv_transfer_blocks_received_total") > 0
    finally:
        stop_all(router, *started)
