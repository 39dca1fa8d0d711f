"""Fields kvserve does not serve: unknown ones ignored (named in a header, logged once),
known ones that would change the answer refused unless neutral; vllm-router's bodies served."""

from __future__ import annotations

import json

import httpx
import pytest

from kvserve.serve.request.fields import HEADER
from tests.serve.conftest import start_server, stop_server

# Text no other test of the shared server sends: a prefix cached here would change
# another test's logprobs in the last digits.
PROMPT = "Fields the server does not serve:"
CHAT = [{"role": "user", "content": "Which fields are ignored?"}]
WARNING = "ignoring request field(s) kvserve does not know"


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/{path}", json=body, timeout=60)


def streamed(url: str, path: str, body: dict) -> tuple[str, dict]:
    """A stream's text joined, and its response headers."""
    text = []
    with httpx.stream("POST", f"{url}/v1/{path}", json=body, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            data = line.removeprefix("data: ")
            if not line.startswith("data: ") or data == "[DONE]":
                continue
            for choice in json.loads(data)["choices"]:
                text.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
        return "".join(text), dict(resp.headers)


def answer(resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def test_unknown_fields_are_ignored_named_in_a_header_and_logged_once(demo):
    srv = start_server(demo)
    try:
        plain = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
        want = answer(post(srv.url, "completions", plain))
        extra = {**plain, "bogus": 1, "odd,name": {"a": [1]}}
        for _ in range(2):  # the same names twice: one warning
            resp = post(srv.url, "completions", extra)
            assert answer(resp) == want
            assert resp.headers[HEADER] == "bogus,odd%2Cname"
        assert HEADER not in post(srv.url, "completions", plain).headers
        chat = {"messages": CHAT, "max_tokens": 6, "temperature": 0}
        want_chat = answer(post(srv.url, "chat/completions", chat))
        body = {**chat, "bogus": 2, "another": None, "stream": True}
        text, headers = streamed(srv.url, "chat/completions", body)
        assert text == want_chat and headers[HEADER] == "bogus,another"
    finally:
        out = stop_server(srv)
    warnings = [line for line in out.splitlines() if WARNING in line]
    assert len(warnings) == 2, out
    assert "'bogus'" in warnings[0] and "'odd,name'" in warnings[0]
    assert "'another'" in warnings[1] and "bogus" not in warnings[1]


FUNCTIONS = [{"name": "f", "parameters": {"type": "object"}}]  # OpenAI's old function calling


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("chat/completions", "functions", FUNCTIONS),
        ("chat/completions", "function_call", {"name": "f"}),
        ("chat/completions", "structural_tag", '{"structures": []}'),
        ("chat/completions", "add_generation_prompt", False),
        ("chat/completions", "continue_final_message", True),
        ("completions", "suffix", " the end"),
        ("completions", "best_of", 3),
        ("completions", "allowed_token_ids", [1, 2]),
        ("completions", "prompt_logprobs", 0),
        ("completions", "use_beam_search", 0),  # not false: refused
        ("completions", "no_stop_trim", True),
    ],
)
def test_an_unsupported_field_that_asks_for_something_is_a_400(server, path, field, value):
    base = {"messages": CHAT} if path.startswith("chat") else {"prompt": PROMPT}
    resp = post(server.url, path, {**base, "max_tokens": 2, field: value})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == field and repr(field) in error["message"]
    assert answer(post(server.url, path, {**base, "max_tokens": 2}))  # still serving


@pytest.mark.parametrize(
    ("path", "neutral"),
    [
        (
            "chat/completions",
            {
                "tools": [],
                "tool_choice": "auto",  # no tools: asks for nothing
                "response_format": {"type": "text"},
                "add_generation_prompt": True,
                "continue_final_message": False,
                "guided_json": None,
                "chat_template_kwargs": {},
            },
        ),
        (
            "completions",
            {"suffix": "", "best_of": 2, "n": 2, "use_beam_search": False, "length_penalty": 1},
        ),
    ],
)
def test_neutral_values_are_accepted_silently(server, path, neutral):
    base = {"messages": CHAT} if path.startswith("chat") else {"prompt": PROMPT}
    base = {**base, "max_tokens": 4, "temperature": 0}
    resp = post(server.url, path, {**base, **neutral})
    assert resp.status_code == 200 and HEADER not in resp.headers
    want = answer(post(server.url, path, {**base, "n": neutral.get("n", 1)}))
    assert answer(resp) == want


VLLM_ROUTER_COMPLETION = {
    "echo": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "return_hidden_states": False,
}
"""What vllm-router 0.1.17 adds to a completion body (seen live, fields.py's docstring)."""
VLLM_ROUTER_CHAT = {
    "logprobs": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
    "include_reasoning": True,
}


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_routers_bodies_are_served_as_the_plain_ones(server, stream):
    cases = [
        (
            "completions",
            {"prompt": PROMPT},
            VLLM_ROUTER_COMPLETION,
            "return_hidden_states",
        ),
        (
            "chat/completions",
            {"messages": CHAT},
            VLLM_ROUTER_CHAT,
            "separate_reasoning,stream_reasoning,return_hidden_states,include_reasoning",
        ),
    ]
    for path, base, added, ignored in cases:
        plain = {"model": server.model, **base, "max_tokens": 5, "temperature": 0.0}
        want = answer(post(server.url, path, plain))
        body = {**plain, "stream": stream, **added}
        if stream:
            got, headers = streamed(server.url, path, body)
        else:
            resp = post(server.url, path, body)
            got, headers = answer(resp), resp.headers
        assert got == want and headers[HEADER] == ignored
