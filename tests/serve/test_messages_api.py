"""`/v1/messages` (issue 30, item 4) through the official `anthropic` client against the
shared real server (the demo checkpoint): plain, streamed, with a tool and its result,
count_tokens; refusals and bad input are 400s in Anthropic's error body, and the server
keeps serving."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import pytest

# Text no other test of the shared server sends (a cached prefix would change others).
QUESTION = "Messages: tell me about the old lighthouse."
SYSTEM = "Messages: answer briefly."
GREEDY = {"temperature": 0}
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def claude(server):
    with anthropic.Anthropic(base_url=server.url, api_key="unused", timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def create(claude, server) -> Any:
    """messages.create with this test's defaults; a keyword overrides one."""

    def create(**kwargs: Any) -> Any:
        # anthropic 2.x has no temperature argument: greedy through the body
        defaults = {"model": server.model, "max_tokens": 8, "extra_body": GREEDY}
        defaults["messages"] = [{"role": "user", "content": QUESTION}]
        return claude.messages.create(**{**defaults, **kwargs})

    return create


def test_plain_message_equals_chat(create, client):
    got = create(system=[{"type": "text", "text": SYSTEM}])
    assert got.type == "message" and got.role == "assistant"
    assert got.stop_reason == "max_tokens" and got.usage.output_tokens == 8
    assert got.content[0].type == "text" and got.content[0].text
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    chat = client.chat.completions.create(
        model=got.model, messages=messages, max_tokens=8, temperature=0
    )
    assert got.content[0].text == chat.choices[0].message.content  # one path: one answer
    assert got.usage.input_tokens + got.usage.cache_read_input_tokens == chat.usage.prompt_tokens


def test_streamed_message_adds_up(claude, create, server):
    plain = create(system=SYSTEM)
    kinds = []
    with claude.messages.stream(
        model=server.model,
        max_tokens=8,
        extra_body=GREEDY,
        system=SYSTEM,
        messages=[{"role": "user", "content": QUESTION}],
    ) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "message_delta" in kinds
    assert final.content[0].text == plain.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8


def test_a_stop_sequence_is_named(create):
    text = create(max_tokens=12).content[0].text
    stop = text.strip().split()[1]
    got = create(max_tokens=12, stop_sequences=[stop])
    assert got.stop_reason == "stop_sequence" and got.stop_sequence == stop
    assert stop not in got.content[0].text


@pytest.fixture(scope="module")
def tool_claude(tool_server):
    """The server whose template renders tools and calls (hermes markers)."""
    with anthropic.Anthropic(base_url=tool_server.url, api_key="unused", timeout=60) as c:
        yield c


def test_a_tool_call_and_its_result(tool_claude, tool_server):
    model = httpx.get(f"{tool_server.url}/v1/models", timeout=30).json()["data"][0]["id"]
    ask = {"model": model, "max_tokens": 160, "extra_body": GREEDY}
    question = [{"role": "user", "content": QUESTION}]
    choice = {"type": "tool", "name": "get_weather"}
    got = tool_claude.messages.create(**ask, tools=[WEATHER], tool_choice=choice, messages=question)
    use = got.content[-1]
    assert got.stop_reason == "tool_use" and use.type == "tool_use"
    assert use.name == "get_weather" and use.input["city"] in ("Paris", "Oslo")
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}
    turns = [
        *question,
        {"role": "assistant", "content": [use.model_dump()]},
        {"role": "user", "content": [result]},
    ]
    answer = tool_claude.messages.create(
        **{**ask, "max_tokens": 4}, tools=[WEATHER], messages=turns
    )
    assert answer.content[0].type == "text" and answer.usage.output_tokens == 4
    assert answer.usage.cache_read_input_tokens >= got.usage.input_tokens // 4 * 4
    with tool_claude.messages.stream(
        **ask, tools=[WEATHER], tool_choice=choice, messages=question
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[-1].input == use.input and final.stop_reason == "tool_use"
    assert "input_json" in kinds  # the SDK's own event for each input_json_delta
    counted = tool_claude.messages.count_tokens(model=model, tools=[WEATHER], messages=turns)
    prompt = answer.usage.input_tokens + answer.usage.cache_read_input_tokens
    assert counted.input_tokens == prompt  # the tools are part of the prompt counted


def test_count_tokens_is_the_prompt_the_answer_counts(claude, create, server):
    counted = claude.messages.count_tokens(
        model=server.model, system=SYSTEM, messages=[{"role": "user", "content": QUESTION}]
    )
    got = create(system=SYSTEM, max_tokens=1)
    assert counted.input_tokens == got.usage.input_tokens + got.usage.cache_read_input_tokens


BAD = [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"made_up": 1}, "made_up"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "image"),
    ({"tools": [{"type": "web_search_20250305", "name": "web"}]}, "client tools"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"stop_sequences": "END"}, "stop_sequences"),
    ({"temperature": -1}, "temperature"),
    ({"system": 3}, "system"),
]


@pytest.mark.parametrize(("extra", "says"), BAD, ids=[s for _, s in BAD])
def test_bad_requests_are_400s_in_anthropics_shape(server, claude, create, extra, says):
    body = {"max_tokens": 2, "messages": [{"role": "user", "content": QUESTION}], **extra}
    body = {k: v for k, v in body.items() if v is not None}
    resp = httpx.post(f"{server.url}/v1/messages", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    got = resp.json()
    assert got["type"] == "error" and got["error"]["type"] == "invalid_request_error"
    assert says in got["error"]["message"]
    if "max_tokens" in body:  # the client itself wants max_tokens
        rest = {k: v for k, v in body.items() if k not in ("max_tokens", "messages")}
        with pytest.raises(anthropic.BadRequestError):
            create(max_tokens=body["max_tokens"], messages=body["messages"], extra_body=rest)
    assert create(max_tokens=1).usage.output_tokens == 1  # still serving
