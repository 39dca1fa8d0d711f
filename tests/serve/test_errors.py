"""Every refusal is OpenAI's error body with the right status, and the server goes on serving."""

from __future__ import annotations

import time

import anthropic
import httpx
import openai
import pytest

from tests.serve.conftest import ENGINE, start_command, start_server, stop_server


def error_of(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def still_serves(server) -> None:
    body = {"model": server.model, "prompt": "ok", "max_tokens": 2}
    resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", -1), ("top_p", 7), ("max_tokens", 0), ("n", "two"), ("suffix", "x")],
)
def test_a_bad_field_is_a_400_naming_it(server, field, value):
    body = {"model": server.model, "prompt": "hi", field: value}
    error = error_of(httpx.post(f"{server.url}/v1/completions", json=body), 400)
    assert error["param"] == field and field in error["message"]
    still_serves(server)


def test_malformed_json_and_missing_prompt_are_400s(server):
    raw = b'{"prompt": "hi", oops'
    headers = {"content-type": "application/json"}
    resp = httpx.post(f"{server.url}/v1/completions", content=raw, headers=headers)
    assert "JSON" in error_of(resp, 400)["message"]
    resp = httpx.post(f"{server.url}/v1/chat/completions", content=b"[1, 2]", headers=headers)
    error_of(resp, 400)
    resp = httpx.post(f"{server.url}/v1/completions", json={"model": server.model})
    assert error_of(resp, 400)["param"] == "prompt"
    still_serves(server)


def test_too_long_is_a_400(server):
    body = {"model": server.model, "prompt": "hi", "max_tokens": 10**6}
    error = error_of(httpx.post(f"{server.url}/v1/completions", json=body), 400)
    assert "max_model_len" in error["message"] and error["param"] == "max_tokens"
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    with client, pytest.raises(openai.BadRequestError):
        client.completions.create(model=server.model, prompt="hi", max_tokens=10**6)
    still_serves(server)


def test_unknown_model_is_a_404(server):
    body = {"model": "no-such-model", "prompt": "hi"}
    error = error_of(httpx.post(f"{server.url}/v1/completions", json=body), 404)
    assert error["code"] == "model_not_found" and "no-such-model" in error["message"]
    body = {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}
    error_of(httpx.post(f"{server.url}/v1/chat/completions", json=body), 404)
    still_serves(server)


def test_a_client_that_leaves_aborts_its_request(demo):
    srv = start_server(demo)
    body = {"model": srv.model, "prompt": "go on", "max_tokens": 2000, "ignore_eos": True}
    try:
        with httpx.stream(
            "POST", f"{srv.url}/v1/completions", json={**body, "stream": True}, timeout=60
        ) as resp:
            next(resp.iter_lines())  # one chunk, then hang up
        # the Responses and Messages APIs' streams too (one path: the same abort)
        messages = [{"role": "user", "content": "go on"}]
        for path, other in (
            ("/v1/responses", {"input": "go on", "max_output_tokens": 2000}),
            ("/v1/messages", {"messages": messages, "max_tokens": 2000}),
        ):
            with httpx.stream(
                "POST", f"{srv.url}{path}", json={**other, "stream": True}, timeout=60
            ) as resp:
                next(resp.iter_lines())
        t0 = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):  # a plain request whose client gives up
            httpx.post(f"{srv.url}/v1/completions", json=body, timeout=0.3)
        still_serves(srv)
        time.sleep(1.0)  # the server notices within one poll (0.5 s)
        print("plain request abandoned after", time.monotonic() - t0)
    finally:
        log = stop_server(srv)
    assert log.count("aborted (client disconnected)") == 4, log[-2000:]


def test_no_chat_template_is_a_400_that_says_so(checkpoints):
    srv = start_server(checkpoints["qwen3"].path)
    try:
        body = {"messages": [{"role": "user", "content": "hi"}]}
        error = error_of(httpx.post(f"{srv.url}/v1/chat/completions", json=body), 400)
        assert "chat template" in error["message"] or "tokenizer" in error["message"]
    finally:
        stop_server(srv)


def test_api_key(demo):
    engine = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    # the model positionally, as `vllm serve MODEL` takes it
    srv = start_command(["serve", demo, *engine], demo, env={"KVSERVE_API_KEY": "s3cret"})
    try:
        url = f"{srv.url}/v1/models"
        error_of(httpx.get(url), 401)
        error_of(httpx.get(url, headers={"Authorization": "Bearer wrong"}), 401)
        error_of(httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi"}), 401)
        assert httpx.get(url, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(f"{srv.url}/health").status_code == 200
        with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="s3cret") as client:
            out = client.completions.create(model=srv.model, prompt="hi", max_tokens=2)
            assert out.usage.completion_tokens == 2
        wrong = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="nope", max_retries=0)
        with wrong, pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        messages = [{"role": "user", "content": "hi"}]
        with anthropic.Anthropic(base_url=srv.url, api_key="s3cret") as claude:  # x-api-key
            got = claude.messages.create(model=srv.model, max_tokens=2, messages=messages)
            assert got.usage.output_tokens == 2
        wrong_claude = anthropic.Anthropic(base_url=srv.url, api_key="nope", max_retries=0)
        with wrong_claude, pytest.raises(anthropic.AuthenticationError):
            wrong_claude.messages.create(model=srv.model, max_tokens=2, messages=messages)
        refused = httpx.post(f"{srv.url}/v1/messages", json={"messages": messages})
        assert refused.status_code == 401  # in Anthropic's shape on its endpoint
        assert refused.json()["error"]["type"] == "authentication_error"
    finally:
        log = stop_server(srv)
    assert "s3cret" not in log


def test_logs_never_hold_prompt_text(demo):
    srv = start_server(demo, "--served-model-name", "tiny")
    try:
        with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x") as client:
            assert [m.id for m in client.models.list().data] == ["tiny"]
            client.completions.create(model="tiny", prompt="SECRET-PROMPT-TEXT", max_tokens=2)
            msgs = [{"role": "user", "content": "SECRET-CHAT-TEXT"}]
            client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2)
            body = {"model": "tiny", "prompt": "SECRET-BAD", "max_tokens": 10**6}
            assert httpx.post(f"{srv.url}/v1/completions", json=body).status_code == 400
    finally:
        log = stop_server(srv)
    assert "Serving" in log and "tiny" in log
    assert "SECRET" not in log
