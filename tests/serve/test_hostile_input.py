"""Bad input at the door (issue 26): each a 400 (or 413) in OpenAI's error body that names
the problem, before anything is allocated; the server goes on serving the others."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.serve.test_errors import error_of, still_serves


def post(server, path: str, body: dict | None = None, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60, **kwargs)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("top_k", 2**63),
        ("max_tokens", 2**63),
        ("n", 10**9),
        ("logprobs", 21),
        ("ignore_eos", "yes"),
        ("stream", ""),
        ("echo", 0),
        ("user", 5),
        ("logit_bias", {"-1": 1}),
        ("logit_bias", {"999999999": 1}),
        ("logit_bias", {"5": 101}),
        ("best_of", 10**9),
    ],
)
def test_out_of_range_or_loose_typed_fields_are_400s(server, field, value):
    body = {"model": server.model, "prompt": "hi", "top_p": 0.5, "temperature": 1.0}
    error = error_of(post(server, "/v1/completions", {**body, field: value}), 400)
    assert field in error["message"], error
    assert len(error["message"]) < 300


def test_a_seed_at_the_int64_edges_samples(server):
    for seed in (-(2**63), 2**63 - 1):
        body = {"prompt": "hi", "seed": seed, "top_k": 2**63 - 1, "top_p": 0.5, "max_tokens": 2}
        assert post(server, "/v1/completions", body).status_code == 200


def test_a_tiny_temperature_is_greedy(server):
    def text(temperature: float) -> str:
        body = {"prompt": "The cache", "temperature": temperature, "max_tokens": 8}
        resp = post(server, "/v1/completions", {**body, "ignore_eos": True})
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["text"]

    assert text(1e-38) == text(0.0) != ""


def test_chat_roles_and_tokenize_flags_are_strict(server):
    chat = {"messages": [{"role": "wizard", "content": "hi"}]}
    assert "role" in error_of(post(server, "/v1/chat/completions", chat), 400)["message"]
    bad = {"prompt": "hi", "add_special_tokens": "no"}
    assert error_of(post(server, "/tokenize", bad), 400)["param"] == "add_special_tokens"


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"prompt": "hi", "x": ' + b"[" * 40 + b"]" * 40 + b"}",
        b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}",
        b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
        b'{"prompt": "hi", "temperature": NaN}',
    ],
)
def test_hostile_json_is_a_400(server, raw):
    headers = {"content-type": "application/json"}
    for path in ("/v1/completions", "/v1/chat/completions"):
        resp = httpx.post(f"{server.url}{path}", content=raw, headers=headers, timeout=60)
        error_of(resp, 400)


@pytest.mark.parametrize("tokens", [[-1], [2**32], [2**70], [1, 10**9]])
def test_detokenize_refuses_ids_outside_the_vocabulary(server, tokens):
    error = error_of(post(server, "/detokenize", {"tokens": tokens}), 400)
    assert error["param"] == "tokens" and "vocabulary" in error["message"]


def test_a_prompt_longer_than_any_that_fits_is_refused_untokenized(server):
    """10 MB of text: refused from its length alone, at once (tokenizing it takes seconds)."""
    started = time.monotonic()
    error = error_of(post(server, "/v1/completions", {"prompt": "a " * 5_000_000}), 400)
    assert "characters" in error["message"] and error["param"] == "prompt"
    error_of(post(server, "/tokenize", {"prompt": "a " * 5_000_000}), 400)
    chat = {"messages": [{"role": "user", "content": "a " * 5_000_000}]}
    assert error_of(post(server, "/v1/chat/completions", chat), 400)["param"] == "messages"
    assert time.monotonic() - started < 10
    still_serves(server)


def test_a_token_id_prompt_past_max_model_len_is_refused_at_the_door(server):
    error = error_of(post(server, "/v1/completions", {"prompt": [1] * 100_000}), 400)
    assert "max_model_len" in error["message"]


def test_an_ignored_field_with_a_huge_name_keeps_the_header_small(server):
    body = {"prompt": "hi", "max_tokens": 1, "x" * 100_000: 1, "y" * 3000: 2}
    resp = post(server, "/v1/completions", body)
    assert resp.status_code == 200
    header = resp.headers["x-kvserve-ignored-fields"]
    assert len(header) < 2100 and header.startswith("xxx")


def test_unknown_routes_and_methods_answer_openai_bodies(server):
    error_of(httpx.get(f"{server.url}/v2/nothing", timeout=10), 404)
    resp = httpx.get(f"{server.url}/v1/completions", timeout=10)
    assert resp.status_code == 405 and "error" in resp.json()


def test_a_body_past_the_limit_is_a_413(server):
    big = b'{"prompt": "' + b"a" * (17 << 20) + b'"}'
    resp = httpx.post(
        f"{server.url}/v1/completions",
        content=big,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert "--max-request-bytes" in error_of(resp, 413)["message"]
    still_serves(server)
