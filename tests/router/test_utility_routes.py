"""`kvserve route`'s utility routes under hostile input: /tokenize, /detokenize and
/v1/models are relayed unread (the router tokenizes nothing for them, its body bound
holds), so the replica's own limits answer, in its error body; the routes it does not
serve (/kv-metadata, /openapi.json, the stored responses, count_tokens) are its own
OpenAI-shaped 404s. A real router in front of a real replica."""

from __future__ import annotations

import httpx
import pytest

from tests.router.test_hostile import assert_openai_error


def test_the_replicas_limits_hold_through_the_router(pair):
    replica, router = pair
    longest = httpx.get(f"{replica.url}/kv-metadata", timeout=10).json()["limits"]
    ids = {"tokens": [1] * 10**6}
    error = assert_openai_error(httpx.post(f"{router.url}/detokenize", json=ids, timeout=60), 400)
    assert error["param"] == "tokens" and f"at most {longest['max_model_len']}" in error["message"]
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
    error = assert_openai_error(httpx.post(f"{router.url}/tokenize", json=body, timeout=60), 400)
    assert error["param"] == "tools" and "--max-tools" in error["message"]
    long = {"prompt": "a" * (longest["max_prompt_chars"] + 1)}
    error = assert_openai_error(httpx.post(f"{router.url}/tokenize", json=long, timeout=60), 400)
    assert error["param"] == "prompt"
    assert httpx.post(f"{router.url}/tokenize", json={"prompt": "hi"}).json()["count"] > 0
    assert httpx.get(f"{router.url}/v1/models", timeout=10).json()["data"]


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/kv-metadata"),
        ("GET", "/openapi.json"),
        ("GET", "/v1/responses/resp_x"),
        ("DELETE", "/v1/responses/resp_x"),
        ("POST", "/v1/messages/count_tokens"),
    ],
)
def test_routes_the_router_does_not_serve_are_openai_404s(pair, method, path):
    _, router = pair
    assert_openai_error(httpx.request(method, f"{router.url}{path}", timeout=10), 404)


def test_the_routers_get_routes_answer(pair):
    _, router = pair
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(f"{router.url}{path}?x={'y' * 2000}", timeout=10).status_code == 200
