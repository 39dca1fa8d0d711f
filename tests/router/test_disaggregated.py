"""`kvserve route --prefill URL --decode URL`: each request's prompt runs on the prefill
engine, its blocks travel to the decode engine (kvserve.transfer), which answers: the same
greedy text as one engine alone, streamed or not, the decode engine's prompt mostly pulled
rather than computed, and the router's event mirror predicts its cached tokens exactly; a
prefill engine gone costs only the recomputation."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.router.conftest import (
    router_total,
    router_value,
    start_split_replicas,
    stop_all,
)
from tests.serve.conftest import metric, scrape, start_command, wait_healthy

pytestmark = pytest.mark.slow

LONG = "Tell me about the sea. " * 12  # several full blocks of prompt


@pytest.fixture(scope="module")
def split(demo):
    started = start_split_replicas(demo)
    prefill, decode = [wait_healthy(s) for s in started]
    route = ["route", "--prefill", prefill.url, "--decode", decode.url]
    router = start_command([*route, "--prefill-min-tokens", "16"], demo)  # LONG is ~90
    try:
        yield prefill, decode, router
    finally:
        stop_all(router, prefill, decode)


def chat(url: str, content: str, stream: bool = False) -> str:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 12,
            "temperature": 0, "stream": stream}  # fmt: skip
    if not stream:
        resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["message"]["content"]
    text = ""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                text += delta.get("content") or ""
    return text


def pulled(server) -> float:
    return metric(scrape(server), "kvserve:external_prefix_cache_hits_total")


def test_a_split_request_answers_as_one_engine(split):
    prefill, decode, router = split
    alone = chat(prefill.url, "A: " + LONG)  # one engine, the whole request
    assert chat(router.url, "B: " + LONG) == chat(prefill.url, "B: " + LONG)
    assert pulled(decode) > 0  # the decode engine pulled the prompt's blocks
    before = pulled(decode)
    assert chat(router.url, "A: " + LONG, stream=True) == alone
    assert pulled(decode) > before
    # Both ends count the transfer on /metrics.
    received = metric(scrape(decode), "kvserve:kv_transfer_blocks_received_total")
    served = metric(scrape(prefill), "kvserve:kv_transfer_blocks_served_total")
    assert served >= received > 0
    assert metric(scrape(decode), "kvserve:kv_transfer_blocks_rejected_total") == 0
    # The prefill engine kept the prompts' blocks for the pulls that released them.
    assert metric(scrape(prefill), "kvserve:kv_transfer_kept_released_by_pull_total") > 0
    # The event mirror predicted the decode engine's cached tokens, pulled blocks included.
    # (The stream asked for no usage: its cached tokens are not reported, not checked.)
    assert router_value(router, "prediction_exact_total", decode) == 1
    assert router_total(router, "prediction_wrong_total") == 0


def test_a_prefill_engine_gone_costs_only_the_recomputation(split):
    prefill, decode, router = split
    want = chat(decode.url, "C: " + LONG)  # the decode engine alone computes it all
    stop_all(prefill)
    assert chat(router.url, "D: " + LONG) == chat(decode.url, "D: " + LONG)
    assert chat(router.url, "C: " + LONG) == want
