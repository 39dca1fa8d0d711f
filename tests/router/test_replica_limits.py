"""`kvserve route` holds a body to the replicas' own limits before it tokenizes anything.

A 15 MB prompt the replica refuses unread is refused unread by the router too (the
replica's 400, at once, no memory kept), a body nested 100,000 deep is the replica's
400, not a 500; a long prompt within the limits is tokenized where it keeps no short
request waiting; the limits travel in the replica's /kv-metadata.
"""

from __future__ import annotations

import json
import random
import string
import threading
import time

import httpx
import pytest

from tests.router.conftest import (
    router_total,
    router_value,
    wait_for,
)
from tests.serve.conftest import scrape

ALONE = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
MESSAGES = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        line = next(x for x in status if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def same_refusal(replica, router, path: str, content: bytes) -> dict:
    """The router's answer to `content`, checked equal to the replica's own 400."""
    headers = {"content-type": "application/json"}
    theirs = httpx.post(f"{replica.url}{path}", content=content, headers=headers, timeout=60)
    ours = httpx.post(f"{router.url}{path}", content=content, headers=headers, timeout=60)
    assert theirs.status_code == 400, theirs.text[:300]
    assert ours.status_code == 400, ours.text[:300]
    assert ours.json() == theirs.json()
    return ours.json()["error"]


def test_the_replica_reports_its_limits(pair):
    replica, _ = pair
    limits = httpx.get(f"{replica.url}/kv-metadata", timeout=10).json()["limits"]
    assert limits["max_model_len"] > 0 and limits["chars_per_token"] >= 32
    assert limits["max_prompt_chars"] == limits["max_model_len"] * limits["chars_per_token"]
    assert limits["max_batch_prompts"] == 256 and limits["max_json_depth"] == 32
    assert limits["max_n"] >= 1
    assert limits["max_tools"] == 128 and limits["tools_in_prompt"] is False  # demo template


def test_a_15_mb_prompt_is_refused_unread_while_others_answer(pair):
    _, router = pair
    alone = httpx.post(f"{router.url}/v1/completions", json=ALONE, timeout=60).json()
    before = rss_mb(router.proc.pid)
    huge = {"prompt": "x" * 15_000_000, "max_tokens": 1}
    answers: list[httpx.Response] = []
    took: list[float] = []

    def send() -> None:
        started = time.monotonic()
        answers.append(httpx.post(f"{router.url}/v1/completions", json=huge, timeout=120))
        took.append(time.monotonic() - started)

    sender = threading.Thread(target=send)
    sender.start()
    meanwhile = httpx.post(f"{router.url}/v1/completions", json=ALONE, timeout=30)
    sender.join(timeout=120)
    assert meanwhile.status_code == 200, meanwhile.text
    assert meanwhile.json()["choices"][0]["text"] == alone["choices"][0]["text"]
    (refused,) = answers
    assert refused.status_code == 400, refused.text[:300]
    error = refused.json()["error"]
    assert error["param"] == "prompt" and "15000000 characters" in error["message"]
    assert took[0] < 5, f"the refusal took {took[0]:.1f}s: was the prompt tokenized?"
    assert rss_mb(router.proc.pid) - before < 200  # the body and its string, not tokens


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", b"[" * 100_000 + b"]" * 100_000),
        ("/v1/chat/completions", b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        ("/v1/embeddings", b'{"input": "a"' + b"}" * 3),
        ("/v1/completions", b'{"prompt": "a", "n": 100000}'),
        ("/v1/completions", b'{"prompt": [' + b'"a",' * 300 + b'"a"]}'),
        ("/v1/chat/completions", json.dumps({"messages": MESSAGES, "tools": TOOLS}).encode()),
    ],
    ids=["deep", "deep-chat", "not-json", "n", "batch", "tools"],
)
def test_the_router_refuses_as_the_replica_does(pair, path, body):
    replica, router = pair
    sent = router_total(router, "requests_total")
    error = same_refusal(replica, router, path, body)
    assert error["type"] == "invalid_request_error"
    assert router_total(router, "requests_total") == sent, "refused after it was sent on"


def test_embeddings_inputs_are_held_to_the_documented_batch_bound(pair):
    _, router = pair
    body = {"input": ["a"] * 257}
    resp = httpx.post(f"{router.url}/v1/embeddings", json=body, timeout=60)
    assert resp.status_code == 400, resp.text[:300]
    assert resp.json()["error"]["param"] == "input" and "256" in resp.json()["error"]["message"]


def test_a_long_prompt_is_the_replicas_to_refuse_by_tokens(pair):
    """Characters within the bound, tokens past max_model_len: the router tokenizes it and
    the replica names the token count."""
    replica, router = pair
    limits = httpx.get(f"{replica.url}/kv-metadata", timeout=10).json()["limits"]
    body = {"prompt": "hello " * (limits["max_model_len"] + 10), "max_tokens": 1}
    resp = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    assert "exceeds max_model_len" in resp.json()["error"]["message"]


@pytest.mark.slow
def test_a_long_in_limit_batch_keeps_no_short_request_waiting(pair):
    """A batch of the longest prompts the replica takes is tokenized on its own thread: a
    request sent meanwhile answers at once (token ids: it needs no tokenizer of the
    replica's either). On one tokenizer thread it would wait for the whole batch. The
    batch's client leaves while the router tokenizes: the replica never gets it."""
    replica, router = pair
    limits = httpx.get(f"{replica.url}/kv-metadata", timeout=10).json()["limits"]
    size = limits["max_prompt_chars"]
    chosen = random.Random(0).choices(string.ascii_lowercase + "   ", k=size * 2)
    prompts = ["".join(chosen[j * 397 : j * 397 + size]) for j in range(220)]  # ~14 MB
    content = json.dumps({"prompt": prompts, "max_tokens": 1}).encode()
    short = {"prompt": [1, 2, 3, 4, 5], "max_tokens": 4, "temperature": 0}
    alone = httpx.post(f"{router.url}/v1/completions", json=short, timeout=60).json()
    sent = router_value(router, "requests_total", replica)
    tokenizations = scrape(router)["kvserve:router_tokenize_seconds_count{}"]

    def leave_early() -> None:
        with pytest.raises(httpx.ReadTimeout):  # gone before the router has tokenized it
            httpx.post(f"{router.url}/v1/completions", content=content, timeout=3)

    sender = threading.Thread(target=leave_early)
    sender.start()
    time.sleep(1)  # the batch is on the router's tokenizer by now
    started = time.monotonic()
    meanwhile = httpx.post(f"{router.url}/v1/completions", json=short, timeout=60)
    waited = time.monotonic() - started
    assert meanwhile.status_code == 200, meanwhile.text
    assert meanwhile.json()["choices"][0]["text"] == alone["choices"][0]["text"]
    assert waited < 5, f"a short request waited {waited:.1f}s behind a long batch"
    sender.join(timeout=60)

    def tokenized() -> bool:  # the batch's tokens counted: it would be sent by now
        return scrape(router)["kvserve:router_tokenize_seconds_count{}"] >= tokenizations + 2

    wait_for(tokenized, timeout=120, what="the batch's tokenizing")
    time.sleep(1)
    assert router_value(router, "requests_total", replica) == sent + 1  # the short one only
