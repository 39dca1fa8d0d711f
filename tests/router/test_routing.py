"""Two replicas behind `kvserve route`: every predicted hit is the hit the replica reports."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.router._workload import conversations
from tests.router.conftest import (
    router_series,
    router_total,
    router_value,
    start_replicas,
    start_router,
    stop_all,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(demo):
    replicas = start_replicas(demo, 2)
    router = None
    try:
        router = start_router(replicas)
        yield replicas, router
    finally:
        stop_all(router, *replicas)


def test_multi_turn_chats_hit_as_predicted_and_as_on_one_engine(cluster):
    replicas, router = cluster
    routed = conversations(router.url, router.model, "routed")
    assert len(routed) == 12
    # Every answer's cached_tokens equals the router's prediction for the replica it chose.
    assert router_total(router, "prediction_exact_total") == 12, router_series(router)
    assert router_total(router, "prediction_wrong_total") == 0
    assert router_total(router, "predicted_hit_tokens_total") == sum(routed)
    assert all(router_value(router, "requests_total", r) > 0 for r in replicas)
    # What routing cost each of them is on the router's /metrics, stage by stage.
    for stage in ("tokenize", "predict"):
        assert router_total(router, f"{stage}_seconds_count") == 12, router_series(router)
        assert router_total(router, f"{stage}_seconds_sum") > 0
    # One engine alone on the same chats (their own salts: no block of the routed run is shared).
    alone = conversations(replicas[1].url, router.model, "alone")
    assert sum(alone) > 0
    assert sum(routed) >= 0.9 * sum(alone)


def sse(url: str, body: dict) -> tuple[list[dict | str], float]:
    """A stream's events (id and created dropped: they differ per request) and the time
    from its first event to its last."""
    events: list[dict | str] = []
    times = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("data: "):
                times.append(time.monotonic())
                data = line.removeprefix("data: ")
                event = data if data == "[DONE]" else json.loads(data)
                if isinstance(event, dict):
                    event.pop("id"), event.pop("created")
                events.append(event)
    return events, times[-1] - times[0]


def test_streams_pass_through_unchanged_and_unbuffered(cluster):
    replicas, router = cluster
    body = {
        "prompt": "Stream me a long answer, token by token.",
        "max_tokens": 48,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    direct, _ = sse(replicas[0].url, {**body, "cache_salt": "direct"})
    routed, spread = sse(router.url, {**body, "cache_salt": "routed"})
    assert routed == direct and len(routed) > 10
    assert spread > 0.02  # buffered, every event would arrive at once


def test_plain_answers_and_errors_pass_through(cluster):
    replicas, router = cluster
    body = {"prompt": [5, 6, 7, 8, 9, 10, 11], "max_tokens": 5, "temperature": 0}
    direct = httpx.post(f"{replicas[0].url}/v1/completions", json=body, timeout=60).json()
    routed = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60).json()
    for answer in (direct, routed):
        answer.pop("id"), answer.pop("created"), answer.pop("usage")
    assert routed == direct
    # Fields are the replica's to judge: an unknown one reaches it (it names it, ignored),
    # an unsupported one that asks for something is its 400.
    extra = httpx.post(f"{router.url}/v1/completions", json={**body, "bogus": 1}, timeout=60)
    assert extra.headers["x-kvserve-ignored-fields"] == "bogus"
    answer = extra.json()
    answer.pop("id"), answer.pop("created"), answer.pop("usage")
    assert answer == direct
    bad = httpx.post(f"{router.url}/v1/completions", json={"prompt": "x", "suffix": "y"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "suffix"
    models = httpx.get(f"{router.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [router.model]
    assert httpx.get(f"{router.url}/health").status_code == 200


def test_embeddings_are_forwarded_steered_by_their_prefix_and_equal_one_servers(cluster):
    replicas, router = cluster
    texts = [f"Embeddings behind the router, item {i}: blocks of memory shared." for i in (1, 2)]

    def requests() -> list[float]:
        return [router_value(router, "requests_total", r) for r in replicas]

    with (
        openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", timeout=60) as routed,
        openai.OpenAI(base_url=f"{replicas[0].url}/v1", api_key="unused", timeout=60) as one,
    ):
        want = one.embeddings.create(model=router.model, input=texts)
        before, predicted = requests(), router_total(router, "predicted_hit_tokens_total")
        got = routed.embeddings.create(model=router.model, input=texts)
        first = requests()
        assert [d.index for d in got.data] == [0, 1] and got.usage == want.usage
        for a, b in zip(got.data, want.data, strict=True):
            assert a.embedding == pytest.approx(b.embedding, abs=1e-5)
        # The batch's blocks are evented like any prompt's: the same batch again is predicted
        # its hit on the replica that holds them, and goes there.
        routed.embeddings.create(model=router.model, input=texts)
        assert router_total(router, "predicted_hit_tokens_total") > predicted
        again = requests()
        assert [b - a for a, b in zip(before, first, strict=True)] == [
            b - a for a, b in zip(first, again, strict=True)
        ]
        with pytest.raises(openai.BadRequestError, match="input"):  # the replica's 400, relayed
            routed.embeddings.create(model=router.model, input=[])
    assert router_total(router, "prediction_wrong_total") == 0  # embeddings are not checked
