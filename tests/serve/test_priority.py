"""vLLM's `priority` under `--scheduling-policy priority` (issue 41, fair admission): lower is
admitted earlier, whole client requests ahead of others; a real server and httpx."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.serve.conftest import Server, start_server, stop_server
from tests.serve.test_batch_admission import (
    BUDGET,
    CHAT,
    chat_text,
    inputs,
    queue_has_work,
    wait_for,
)
from tests.serve.test_errors import error_of


@pytest.fixture(scope="module")
def ranked(demo) -> Iterator[Server]:
    srv = start_server(demo, "--max-num-batched-tokens", BUDGET, "--scheduling-policy", "priority")
    yield srv
    stop_server(srv)


def test_a_lower_priority_batch_sent_later_finishes_first(ranked):
    """Two 256-input batches: the later one, with the lower value, runs ahead of the other
    (round-robin alone would finish the earlier one first); a chat at the lowest value answers
    as alone while both run."""
    alone = chat_text(ranked)
    done: dict[str, float] = {}

    def batch(name: str, priority: int) -> None:
        body = {"input": inputs(name), "priority": priority}
        resp = httpx.post(f"{ranked.url}/v1/embeddings", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        done[name] = time.monotonic()

    late = threading.Thread(target=batch, args=("late", 10))
    late.start()
    wait_for(lambda: queue_has_work(ranked))
    urgent = threading.Thread(target=batch, args=("urgent", -5))
    urgent.start()
    body: dict[str, Any] = {**CHAT, "priority": -100}
    resp = httpx.post(f"{ranked.url}/v1/chat/completions", json=body, timeout=30)
    chat_done = time.monotonic()
    assert resp.json()["choices"][0]["message"]["content"] == alone
    late.join(120)
    urgent.join(120)
    assert chat_done < done["urgent"] < done["late"]


def test_priority_must_still_be_an_integer(ranked):
    body = {"input": "hi", "priority": "first"}
    error = error_of(httpx.post(f"{ranked.url}/v1/embeddings", json=body, timeout=30), 400)
    assert error["param"] == "priority"
