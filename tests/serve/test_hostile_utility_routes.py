"""The utility routes as a hostile client uses them: /tokenize, /detokenize,
/v1/messages/count_tokens, the stored responses' GET and DELETE, and the GET routes.
Each size is refused by a 400 in the API's own error body, naming the field and the limit,
before anything is tokenized or decoded; the server keeps serving. A real server, httpx and
the anthropic client."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import pytest

from tests.serve.conftest import Server
from tests.serve.test_errors import error_of, still_serves

ASK = [{"role": "user", "content": "hello"}]


def post(server: Server, path: str, body: Any) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def limits(server: Server) -> dict[str, Any]:
    return httpx.get(f"{server.url}/kv-metadata", timeout=10).json()["limits"]


def tool(i: int, description: str = "") -> dict[str, Any]:
    params = {"type": "object", "properties": {"x": {"type": "string"}}}
    return {"type": "function", "function": {"name": f"f{i}", "description": description,
                                             "parameters": params}}  # fmt: skip


def test_tokenize_refuses_more_tools_than_chat_takes(tool_server):
    body = {"messages": ASK, "tools": [tool(i) for i in range(129)]}
    error = error_of(post(tool_server, "/tokenize", body), 400)
    assert error["param"] == "tools" and "--max-tools" in error["message"]
    body["tools"] = body["tools"][:128]
    assert post(tool_server, "/tokenize", body).json()["count"] > 0


def test_tools_longer_than_any_prompt_are_refused_before_rendering(tool_server):
    """The template writes the tools into the prompt: their text counts toward the longest
    prompt there can be, on /tokenize, chat and count_tokens alike."""
    bound = limits(tool_server)["max_prompt_chars"]
    huge = [tool(i, "d" * (bound // 100 + 100)) for i in range(100)]
    body = {"messages": ASK, "tools": huge}
    for path in ("/tokenize", "/v1/chat/completions"):
        error = error_of(post(tool_server, path, body), 400)
        assert error["param"] == "tools" and f"at most {bound}" in error["message"]
    claude_tools = [
        {"name": t["function"]["name"], "description": t["function"]["description"],
         "input_schema": t["function"]["parameters"]} for t in huge
    ]  # fmt: skip
    with anthropic.Anthropic(base_url=tool_server.url, api_key="unused", timeout=60) as a:
        with pytest.raises(anthropic.BadRequestError, match=f"at most {bound}"):
            a.messages.count_tokens(model="demo-tools", tools=claude_tools, messages=ASK)
        with pytest.raises(anthropic.BadRequestError, match="--max-tools"):
            a.messages.count_tokens(
                model="demo-tools", messages=ASK, tools=[dict(claude_tools[0], name=f"f{i}",
                    description="") for i in range(129)],
            )  # fmt: skip
    resp = post(tool_server, "/v1/messages/count_tokens", {"messages": ASK, "tools": [1]})
    assert resp.status_code == 400 and resp.json()["type"] == "error"  # Anthropic's shape
    chat = {"model": "demo-tools", "messages": ASK, "max_tokens": 2}
    assert post(tool_server, "/v1/chat/completions", chat).status_code == 200


def test_tokenize_300_messages_is_bounded_by_their_text(server):
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(301)]
    assert post(server, "/tokenize", {"messages": many}).json()["count"] > 300
    bound = limits(server)["max_prompt_chars"]
    long = [{**m, "content": "a" * (bound // 300 + 1)} for m in many]
    error = error_of(post(server, "/tokenize", {"messages": long}), 400)
    assert error["param"] == "messages" and f"at most {bound}" in error["message"]
    error = error_of(post(server, "/tokenize", {"prompt": "a" * (bound + 1)}), 400)
    assert error["param"] == "prompt" and f"at most {bound}" in error["message"]


def test_detokenize_takes_at_most_max_model_len_ids(server):
    longest = limits(server)["max_model_len"]
    for count in (longest + 1, 10**6):
        error = error_of(post(server, "/detokenize", {"tokens": [1] * count}), 400)
        assert error["param"] == "tokens"
        assert f"{count} ids; at most {longest} (max_model_len)" in error["message"]
    assert isinstance(post(server, "/detokenize", {"tokens": [1] * longest}).json()["prompt"], str)
    error = error_of(post(server, "/detokenize", {"tokens": "1 2 3"}), 400)
    assert error["param"] == "tokens"
    still_serves(server)


@pytest.mark.parametrize("rid", ["resp_nope", "r" * 4000, "%00", "..%2F..%2Fetc"])
def test_unknown_stored_response_ids_are_openai_404s(server, rid):
    for method in ("GET", "DELETE"):
        resp = httpx.request(method, f"{server.url}/v1/responses/{rid}", timeout=30)
        assert resp.status_code == 404, resp.text
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    "path", ["/v1/models", "/health", "/version", "/kv-metadata", "/openapi.json", "/metrics"]
)
def test_the_get_routes_ignore_junk_queries_and_bodies(server, path):
    resp = httpx.request(
        "GET", f"{server.url}{path}?x={'y' * 2000}&model=nope", content=b"{" * 10_000, timeout=30
    )
    assert resp.status_code == 200, resp.text
    assert len(resp.content) < 1_000_000  # what each returns is bounded by the server, not us
