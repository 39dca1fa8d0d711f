"""Requests that expand into many engine requests (issue 41, defects 1 and 6): an embeddings
batch or a completions batch is bounded, refused before tokenizing when too large, aborted
whole when its client leaves, and cannot starve a chat queued after it (admission is
round-robin between client requests). A real server, httpx and the openai client."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.serve.conftest import Server, metric, scrape, start_server, stop_server
from tests.serve.test_errors import error_of, still_serves

CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8, "temperature": 0}
BUDGET = "64"  # tokens a step: a 256-input batch takes hundreds of steps
SEATS = 64  # --max-num-seqs (and so --max-n): n = 64 completions hold every seat
LONG = 200  # their max_tokens: they hold the seats for LONG steps


def inputs(tag: str, words: int = 4) -> list[str]:
    """256 distinct texts (no two share a prefix block, so none is a cache hit)."""
    return [f"{tag} input {i}: " + "some words to embed here " * words for i in range(256)]


def chat_text(server: Server) -> str:
    resp = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]["content"]


def queue_has_work(server: Server) -> bool:
    values = scrape(server)
    waiting = metric(values, "kvserve:num_requests_waiting")
    return waiting + metric(values, "kvserve:num_requests_running") > 0


def wait_for(condition, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "not within the time allowed"
        time.sleep(0.1)


def rss_mib(server: Server) -> float:
    with open(f"/proc/{server.proc.pid}/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


@pytest.fixture(scope="module")
def busy(demo) -> Iterator[Server]:
    """A server with a small step budget, so a full batch is long enough to wait behind."""
    srv = start_server(demo, "--max-num-batched-tokens", BUDGET)
    yield srv
    stop_server(srv)


# -- limits, on the shared server ------------------------------------------------------


@pytest.mark.parametrize("count", [257, 100_000])
def test_more_than_256_embeddings_inputs_is_a_400_naming_input(server, count):
    body = {"model": server.model, "input": ["x"] * count}
    error = error_of(httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=30), 400)
    assert error["param"] == "input" and "at most 256" in error["message"]
    ids = {"model": server.model, "input": [[1, 2]] * count}
    error = error_of(httpx.post(f"{server.url}/v1/embeddings", json=ids, timeout=30), 400)
    assert error["param"] == "input" and "at most 256" in error["message"]
    prompts = {"model": server.model, "prompt": ["x"] * count}
    error = error_of(httpx.post(f"{server.url}/v1/completions", json=prompts, timeout=30), 400)
    assert error["param"] == "prompt" and "at most 256" in error["message"]
    still_serves(server)


def test_each_embeddings_input_is_checked_before_any_is_tokenized(server):
    info = httpx.post(f"{server.url}/tokenize", json={"prompt": "x"}, timeout=30).json()
    limit = info["max_model_len"]
    fine = "a short text"
    body: dict[str, Any] = {"input": [fine, [1] * limit]}
    error = error_of(httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=30), 400)
    assert error["param"] == "input" and f"input[1] is {limit} tokens" in error["message"]
    body = {"input": [fine, [1, 10**9]]}
    error = error_of(httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=30), 400)
    assert error["param"] == "input" and "outside the vocabulary" in error["message"]
    long = "y" * (limit * 64 * 8)  # far past max_model_len tokens of the longest token
    error = error_of(httpx.post(f"{server.url}/v1/embeddings", json={"input": long}), 400)
    assert error["param"] == "input" and "characters" in error["message"]
    still_serves(server)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/embeddings"])
def test_priority_is_an_integer_and_needs_the_priority_policy(server, path):
    body: dict[str, Any] = {"prompt": "hi", "input": "hi", "max_tokens": 2}
    if path == "/v1/chat/completions":
        body = {**CHAT, "max_tokens": 2}
    url = f"{server.url}{path}"
    for bad in ("high", 1.5, True, 2**63):
        error = error_of(httpx.post(url, json={**body, "priority": bad}, timeout=30), 400)
        assert error["param"] == "priority" and "integer" in error["message"]
    error = error_of(httpx.post(url, json={**body, "priority": 1}, timeout=30), 400)
    assert error["param"] == "priority" and "--scheduling-policy priority" in error["message"]
    assert httpx.post(url, json={**body, "priority": 0}, timeout=30).status_code == 200
    resp = httpx.post(url, json={**body, "priority": None}, timeout=30)
    assert resp.status_code == 200 and "priority" not in resp.headers.get(
        "x-kvserve-ignored-fields", ""
    )


# -- fairness and leaving early, on a server with a small step budget --------------------


def _behind_a_batch(busy: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """Send `body` to `path`; once the engine queues it, a chat: the chat answers (its text
    as alone) while the batch still runs, and the batch then answers in full."""
    alone = chat_text(busy)
    done: dict[str, Any] = {}

    def batch() -> None:
        resp = httpx.post(f"{busy.url}{path}", json=body, timeout=120)
        done["batch"] = (resp, time.monotonic())

    thread = threading.Thread(target=batch)
    thread.start()
    try:
        wait_for(lambda: queue_has_work(busy))
        t0 = time.monotonic()
        assert chat_text(busy) == alone
        chat_done = time.monotonic()
        assert chat_done - t0 < 20  # liveness only: alone it takes a fraction of a second
    finally:
        thread.join(120)
    resp, batch_done = done["batch"]
    assert resp.status_code == 200, resp.text
    assert chat_done < batch_done  # admitted between the batch's requests, not after them
    answer = resp.json()
    assert len(answer.get("data") or answer["choices"]) == 256
    return answer


def test_a_chat_behind_a_256_input_embeddings_batch_answers_first(busy):
    texts = inputs("fair")
    answer = _behind_a_batch(busy, "/v1/embeddings", {"input": texts})
    for i in (0, 255):  # interleaved with the chat, each input's vector is its own alone
        body = {"input": texts[i], "encoding_format": "float"}
        one = httpx.post(f"{busy.url}/v1/embeddings", json=body, timeout=30).json()
        got = answer["data"][i]["embedding"]
        assert got == pytest.approx(one["data"][0]["embedding"], abs=1e-5)


def test_a_chat_behind_a_256_prompt_completions_batch_answers_first(busy):
    prompts = [f"prompt {i}: please go on and on" for i in range(256)]
    body = {"prompt": prompts, "max_tokens": 8, "temperature": 0}
    answer = _behind_a_batch(busy, "/v1/completions", body)
    for i in (0, 255):  # each prompt's text is its own alone
        one = {"prompt": prompts[i], "max_tokens": 8, "temperature": 0}
        alone = httpx.post(f"{busy.url}/v1/completions", json=one, timeout=30).json()
        assert answer["choices"][i]["text"] == alone["choices"][0]["text"]


def generated(server: Server) -> float:
    return metric(scrape(server), "kvserve:generation_tokens_total")


@pytest.fixture(scope="module")
def seated(demo) -> Iterator[Server]:
    """SEATS seats, and KV blocks for SEATS sequences of LONG tokens (no preemption)."""
    srv = start_server(demo, "--max-num-seqs", str(SEATS), "--num-kv-blocks", "4096")
    yield srv
    stop_server(srv)


def test_a_chat_behind_n_completions_holding_every_seat_answers_within_a_few_steps(seated):
    """n = 64 completions hold every seat (--max-num-seqs 64) for LONG steps; a chat sent
    meanwhile takes a seat from them (kvserve/engine/seats.py) and answers, with its text
    alone, while they still have most of their tokens to go (waiting for a free seat, it
    would start after all SEATS * LONG of them)."""
    body = {"prompt": "go on", "n": SEATS, "max_tokens": LONG, "ignore_eos": True, "seed": 1}
    alone = chat_text(seated)
    start = generated(seated)
    done: dict[str, Any] = {}

    def many() -> None:
        done["batch"] = httpx.post(f"{seated.url}/v1/completions", json=body, timeout=300)

    thread = threading.Thread(target=many)
    thread.start()
    try:
        wait_for(lambda: metric(scrape(seated), "kvserve:num_requests_running") >= SEATS)
        assert chat_text(seated) == alone
        by_then = generated(seated) - start
    finally:
        thread.join(300)
    assert done["batch"].status_code == 200, done["batch"].text
    assert len(done["batch"].json()["choices"]) == SEATS
    assert by_then < SEATS * LONG // 2, by_then


@pytest.fixture(scope="module")
def small_pool(demo) -> Iterator[Server]:
    """KV blocks for a few of POOL_SEATS sequences of LONG tokens: blocks, not seats, run
    out (each grows to 51 blocks of 4 tokens; 8 of them would need 2.5 times the pool)."""
    srv = start_server(demo, "--max-num-seqs", "64", "--num-kv-blocks", "160")
    yield srv
    stop_server(srv)


POOL_SEATS = 8


@pytest.mark.slow
def test_a_chat_behind_n_completions_filling_the_kv_pool_answers_within_a_few_steps(small_pool):
    """n = 8 completions of LONG tokens fill a 160-block pool (they preempt each other as they
    grow); a chat sent once the pool is full takes its blocks from them (seats.py) and is
    never the one preempted as they grow: it answers with its text alone while they still
    have most of their tokens to go (waiting for free blocks, it would start only when one
    of them finishes). Counted in their tokens generated while it runs, not in seconds."""
    server = small_pool
    body = {"prompt": "go on", "n": POOL_SEATS, "max_tokens": LONG, "ignore_eos": True,
            "seed": 1}  # fmt: skip
    alone = chat_text(server)
    done: dict[str, Any] = {}

    def many() -> None:
        done["batch"] = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)

    thread = threading.Thread(target=many)
    thread.start()
    try:  # the pool is full once they preempt each other
        wait_for(lambda: metric(scrape(server), "kvserve:num_preemptions_total") > 0, 120)
        sent = generated(server)
        assert chat_text(server) == alone
        meanwhile = generated(server) - sent
    finally:
        thread.join(300)
    assert done["batch"].status_code == 200, done["batch"].text
    assert len(done["batch"].json()["choices"]) == POOL_SEATS
    # Taking blocks from them, ~100 of their tokens pass meanwhile on a quiet machine (its
    # prefill and 8 tokens, 3-4 of them decoding), ~270 under the whole suite's load;
    # waiting for one of them to finish, ~380 quiet. Over HTTP the load blurs the two, so
    # this bounds it by a quarter of their work: tests/engine/test_seats.py pins the steps.
    assert meanwhile < POOL_SEATS * LONG // 4, meanwhile


def finished(server: Server, reason: str) -> float:
    return metric(scrape(server), "kvserve:request_success_total", finished_reason=reason)


def send_and_leave(
    server: Server, path: str, body: dict[str, Any], queued: bool, key: str | None = None
) -> None:
    """POST `body` on a raw socket and hang up: once the engine has work (`queued`), or at
    once (its prompts may still be tokenized); `key`: the API key sent."""
    raw = json.dumps(body).encode()
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
        f"Content-Length: {len(raw)}\r\n\r\n"
    )
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head.encode() + raw)
        if queued:
            wait_for(lambda: queue_has_work(server))


LONG_PROMPTS = [f"leave {i}: " + "a long prompt to prefill " * 40 for i in range(256)]
LEAVERS = {
    "embeddings": ("/v1/embeddings", {"input": LONG_PROMPTS}),
    "completions": ("/v1/completions", {"prompt": LONG_PROMPTS, "max_tokens": 4}),
}


@pytest.mark.parametrize("queued", [True, False], ids=["while-queued", "at-once"])
@pytest.mark.parametrize("kind", list(LEAVERS))
def test_a_batch_whose_client_leaves_is_aborted_whole(busy, kind, queued):
    """A client that hangs up before its answer, while its ~250-token inputs wait in the
    engine or right after sending: what was not computed yet is aborted (alone, all 256
    would be computed, a thousand steps), the queue empties, a chat answers as alone, and
    the server's memory returns near its start."""
    alone = chat_text(busy)
    ran_before = finished(busy, "stop") + finished(busy, "length")
    aborted, rss = finished(busy, "abort"), rss_mib(busy)
    path, body = LEAVERS[kind]
    send_and_leave(busy, path, {**body, "user": f"{kind}-{queued}"}, queued)
    wait_for(lambda: not queue_has_work(busy), seconds=15)
    time.sleep(1.0)  # anything still running would show in the counters now
    assert not queue_has_work(busy)
    ran = finished(busy, "stop") + finished(busy, "length") - ran_before
    assert ran < 128, ran
    if queued:
        assert finished(busy, "abort") - aborted >= 128
    assert chat_text(busy) == alone
    assert rss_mib(busy) - rss < 64
