"""Tool calling through the openai client against a real `kvserve serve`: the demo checkpoint
(random weights) with a template that renders tools (hermes markers, `<tool_call>` one
token). A forced call (`required`, a named function) is the grammar's doing alone, so it
must parse and validate against its tool's schema; `auto` leaves free text alone and
holds a started call to the schema."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from _tool_checkpoint import TOOL_MODEL

WEATHER = {
    "type": "object",
    "properties": {
        # a pattern and a range bound what a random model writes (else it rambles on)
        "city": {"type": "string", "pattern": "^[A-Za-z]{1,8}$"},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
BAD_REGEX = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}
ASK = [{"role": "user", "content": "Weather in Paris for two days, and the time there?"}]
MODEL = TOOL_MODEL
TRIGGER_TOKEN = 2048
"""`<tool_call>` in the test checkpoint's vocabulary (_tool_checkpoint.py)."""


@pytest.fixture(scope="module")
def tool_client(tool_server):
    with openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key="unused", timeout=60) as c:
        yield c


def ask(client: openai.OpenAI, **kwargs: Any) -> Any:
    args = {"model": MODEL, "messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 96}
    return client.chat.completions.create(**{**args, **kwargs})


def valid_calls(calls: list[Any]) -> list[tuple[str, dict]]:
    """Each call's name and arguments, checked: an id, a known tool, its schema."""
    out = []
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


def streamed(client: openai.OpenAI, **kwargs: Any) -> tuple[str, list[dict], str, Any]:
    """A stream joined as a client joins it: (content, calls by index, finish, usage)."""
    content, calls, finish, usage = "", {}, None, None
    for chunk in ask(client, stream=True, stream_options={"include_usage": True}, **kwargs):
        if not chunk.choices:
            usage = chunk.usage
            continue
        assert usage is None, "usage comes last"
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            if piece.index not in calls:  # the first piece: id, type, name, arguments ""
                assert piece.id and piece.type == "function" and piece.function.name
                assert piece.function.arguments == ""
                calls[piece.index] = {"id": piece.id, "name": piece.function.name, "args": ""}
            else:
                assert piece.id is None and piece.function.name is None
                calls[piece.index]["args"] += piece.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert usage is not None and usage.completion_tokens > 0
    return content, [calls[i] for i in sorted(calls)], finish, usage


@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_a_forced_call_parses_and_validates_streamed_or_not(tool_client, choice):
    whole = ask(tool_client, tool_choice=choice, parallel_tool_calls=False)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls"
    assert message.content is None and len(message.tool_calls) == 1
    [(name, arguments)] = valid_calls(message.tool_calls)
    if isinstance(choice, dict):
        assert name == "get_weather"
    content, calls, finish, _ = streamed(tool_client, tool_choice=choice, parallel_tool_calls=False)
    assert finish == "tool_calls" and content == ""  # no marker leaks into the content
    assert [(c["name"], json.loads(c["args"])) for c in calls] == [(name, arguments)]


def test_required_with_parallel_calls_gives_valid_calls(tool_client):
    whole = ask(tool_client, tool_choice="required", max_tokens=400)
    assert whole.choices[0].finish_reason == "tool_calls"  # after a call: another, or the end
    assert len(valid_calls(whole.choices[0].message.tool_calls)) >= 1


def test_auto_leaves_free_text_as_the_model_writes_it(tool_client, tool_server):
    """No trigger in the output: the answer is the model's own text, token for token the
    same as the same prompt without any grammar (the lazy grammar changed nothing)."""
    answer = ask(tool_client, tool_choice="auto", max_tokens=24)
    assert answer.choices[0].message.tool_calls is None
    ids = httpx.post(
        f"{tool_server.url}/tokenize", json={"messages": ASK, "tools": TOOLS}, timeout=30
    ).json()["tokens"]
    plain = tool_client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=24)
    assert answer.choices[0].message.content == plain.choices[0].text
    assert answer.choices[0].finish_reason == plain.choices[0].finish_reason


def test_auto_holds_a_started_call_to_its_schema(tool_client):
    bias = {str(TRIGGER_TOKEN): 100}  # the model starts a call at once
    whole = ask(tool_client, tool_choice="auto", parallel_tool_calls=False, logit_bias=bias)
    assert whole.choices[0].finish_reason == "tool_calls"
    assert whole.choices[0].message.content is None
    [(name, arguments)] = valid_calls(whole.choices[0].message.tool_calls)
    content, calls, finish, _ = streamed(
        tool_client, tool_choice="auto", parallel_tool_calls=False, logit_bias=bias
    )
    assert (content, finish) == ("", "tool_calls")
    assert [(c["name"], json.loads(c["args"])) for c in calls] == [(name, arguments)]


def test_tool_choice_none_neither_offers_nor_parses(tool_client, tool_server):
    bias = {str(TRIGGER_TOKEN): 100}
    answer = ask(tool_client, tool_choice="none", logit_bias=bias, max_tokens=4)
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].message.content.startswith("<tool_call>")  # text, not parsed
    rendered = detokenized(tool_server, {"messages": ASK, "tools": TOOLS, "tool_choice": "none"})
    assert "get_weather" not in rendered


ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.mark.parametrize("bias", [-100, 100], ids=["no-call", "call"])
def test_auto_with_response_format_gives_calls_or_a_matching_answer(tool_client, bias):
    """The Agents SDK's `output_type` with tools: a reply is calls, or JSON of the schema."""
    response_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}}
    whole = ask(
        tool_client,
        tool_choice="auto",
        parallel_tool_calls=False,
        response_format=response_format,
        logit_bias={str(TRIGGER_TOKEN): bias},  # -100: the call's marker token is out
    )
    message = whole.choices[0].message
    if bias > 0:
        assert whole.choices[0].finish_reason == "tool_calls" and message.content is None
        assert len(valid_calls(message.tool_calls)) == 1
    else:
        assert whole.choices[0].finish_reason == "stop" and message.tool_calls is None
        jsonschema.validate(json.loads(message.content), ANSWER)


HISTORY = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
]


def detokenized(server, body: dict) -> str:
    tokens = httpx.post(f"{server.url}/tokenize", json=body, timeout=30)
    assert tokens.status_code == 200, tokens.text
    ids = {"tokens": tokens.json()["tokens"]}
    text = httpx.post(f"{server.url}/detokenize", json=ids, timeout=30)
    return text.json()["prompt"]


@pytest.mark.parametrize("content", [None, ""], ids=["null", "empty"])
def test_history_calls_and_results_reach_the_template(tool_client, tool_server, content):
    history = [HISTORY[0], {**HISTORY[1], "content": content}, HISTORY[2]]
    prompt = detokenized(tool_server, {"messages": history, "tools": TOOLS})
    # the call rendered with its arguments as an object (a string would be quoted)
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}' in prompt
    assert "<tool_response>\nsunny, 24 C\n</tool_response>" in prompt
    assert '"name": "get_time"' in prompt  # the tools offered
    answer = ask(tool_client, messages=history, max_tokens=4)
    assert answer.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools", "name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
            "tools",
            "parameters must be a JSON schema",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
            "tools",
            "not a JSON type",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "'nope', which is not one of the tools",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (  # a schema xgrammar cannot compile: its reason, in the client's words
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": BAD_REGEX}}]},
            "tools",
            "tools: a function's parameters schema: Regex parsing error",
        ),
        ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls", "true or false"),
    ],
)
def test_bad_tools_are_a_400_naming_the_field(tool_server, fields, param, says):
    body = {"messages": ASK, "max_tokens": 2, **fields}
    resp = httpx.post(f"{tool_server.url}/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and says in error["message"], error
    plain = httpx.post(
        f"{tool_server.url}/v1/chat/completions",
        json={"messages": ASK, "max_tokens": 1, "tools": TOOLS},
    )
    assert plain.status_code == 200  # the server keeps serving
