"""`/v1/responses` (issue 30, item 3) through the official openai client and the Agents SDK
against the shared real server (the demo checkpoint): plain, streamed, stored and continued
(a prefix-cache hit), structured, with a function tool and its output; refusals are 400s in
OpenAI's body and the server keeps serving."""

from __future__ import annotations

import json
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest

from tests.serve.conftest import ENGINE

# Text no other test of the shared server sends (a cached prefix would change others).
QUESTION = "Responses: tell me about the quiet harbour."
SCHEMA = {
    "type": "object",
    "properties": {"size": {"enum": ["small", "large"]}, "count": {"type": "integer"}},
    "required": ["size", "count"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def create(client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs = {"input": QUESTION, "max_output_tokens": 8, "temperature": 0, **kwargs}
    return client.responses.create(**kwargs)


def test_plain_create_get_delete(client, server):
    got = create(client, instructions="Answer briefly.")
    assert got.object == "response" and got.status == "incomplete"  # 8 tokens of gibberish
    assert got.incomplete_details.reason == "max_output_tokens"
    assert got.output_text and got.output[0].type == "message"
    assert got.output[0].status == "incomplete"
    assert got.usage.output_tokens == 8 and got.usage.input_tokens > 8
    assert got.instructions == "Answer briefly." and got.max_output_tokens == 8
    same = create(client, instructions="Answer briefly.")
    assert same.output_text == got.output_text  # greedy
    assert client.responses.retrieve(got.id).output_text == got.output_text
    assert client.responses.delete(got.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(got.id)
    messages = [{"role": "system", "content": "Answer briefly."}]
    messages.append({"role": "user", "content": QUESTION})
    chat = client.chat.completions.create(
        model=got.model, messages=messages, max_tokens=8, temperature=0
    )
    assert chat.choices[0].message.content == got.output_text  # one path: the same answer


def test_streamed_events_add_up_to_the_response(client):
    kinds, deltas, numbers = [], [], []
    final = None
    with create(client, stream=True, input=[{"role": "user", "content": QUESTION}]) as stream:
        for event in stream:
            kinds.append(event.type)
            numbers.append(event.sequence_number)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
    assert numbers == list(range(len(kinds)))
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert final is not None and final.output_text == "".join(deltas)
    assert final.output_text == create(client).output_text  # streamed or not: one answer


def test_previous_response_id_continues_and_hits_the_prefix_cache(client, server):
    first = create(client, input="Responses: a first turn about rivers.", max_output_tokens=12)
    second = create(client, input="And then?", previous_response_id=first.id)
    turn1 = [{"role": "user", "content": "Responses: a first turn about rivers."}]
    turn2 = [
        *turn1,
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"},
    ]
    ids1, ids2 = (
        httpx.post(f"{server.url}/tokenize", json={"messages": m}, timeout=30).json()["tokens"]
        for m in (turn1, turn2)
    )
    assert second.usage.input_tokens == len(ids2)  # the whole conversation was the prompt
    assert ids2[: len(ids1)] == ids1
    block = ENGINE["block_size"]
    assert second.usage.input_tokens_details.cached_tokens >= len(ids1) // block * block
    unstored = create(client, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        create(client, previous_response_id=unstored.id)


def test_text_format_json_schema_validates(client):
    fmt = {"type": "json_schema", "name": "box", "schema": SCHEMA, "strict": True}
    got = create(client, text={"format": fmt}, max_output_tokens=160)
    assert got.status == "completed"
    jsonschema.validate(json.loads(got.output_text), SCHEMA)
    got = create(client, text={"format": {"type": "json_object"}}, max_output_tokens=200)
    assert isinstance(json.loads(got.output_text), dict)


@pytest.fixture(scope="module")
def tool_client(tool_server):
    """The server whose template renders tools and calls (hermes markers)."""
    with openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key="unused", timeout=60) as c:
        yield c


NAMED = {"type": "function", "name": "get_weather"}


def test_a_function_tool_and_its_output(tool_client):
    got = create(tool_client, tools=[WEATHER], tool_choice=NAMED, max_output_tokens=160)
    call = got.output[-1]
    assert got.status == "completed" and call.type == "function_call"
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments)["city"] in ("Paris", "Oslo")
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    answer = create(tool_client, tools=[WEATHER], previous_response_id=got.id, input=[output])
    assert answer.output_text and answer.usage.input_tokens > got.usage.input_tokens
    block = ENGINE["block_size"]  # the continued conversation hits the first turn's blocks
    turn1 = got.usage.input_tokens // block * block
    assert answer.usage.input_tokens_details.cached_tokens >= turn1
    function_call = {
        "type": "function_call",
        "call_id": call.call_id,
        "name": call.name,
        "arguments": call.arguments,
    }
    items = [{"role": "user", "content": QUESTION}, function_call, output]
    again = create(tool_client, tools=[WEATHER], input=items)  # the conversation, sent whole
    assert again.output_text == answer.output_text
    assert again.usage.input_tokens == answer.usage.input_tokens


def test_streamed_function_call_events(tool_client):
    kinds, fragments, done = [], [], None
    with create(
        tool_client, tools=[WEATHER], tool_choice=NAMED, max_output_tokens=160, stream=True
    ) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.function_call_arguments.delta":
                fragments.append(event.delta)
            if event.type == "response.completed":
                done = event.response
    assert "response.function_call_arguments.done" in kinds
    call = done.output[-1]
    assert call.type == "function_call" and "".join(fragments) == call.arguments
    whole = create(tool_client, tools=[WEATHER], tool_choice=NAMED, max_output_tokens=160)
    # the same call; the chat path streams the model's own spacing, and re-dumps it whole
    assert json.loads(whole.output[-1].arguments) == json.loads(call.arguments)


def test_the_agents_sdk_default_responses_model_calls_a_function_tool(tool_server):
    agents = pytest.importorskip("agents")
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny"

    agents.set_tracing_disabled(True)
    sdk_client = openai.AsyncOpenAI(base_url=f"{tool_server.url}/v1", api_key="unused")
    # the SDK's default model class (what set_default_openai_api("responses") picks by name)
    name = httpx.get(f"{tool_server.url}/v1/models", timeout=30).json()["data"][0]["id"]
    model = agents.OpenAIResponsesModel(model=name, openai_client=sdk_client)
    agent = agents.Agent(
        name="weather",
        instructions="Use the tool.",
        model=model,
        tools=[get_weather],
        model_settings=agents.ModelSettings(tool_choice="required", max_tokens=96, temperature=0),
        # the run ends with the tool's result: random weights would answer until the token
        # limit, which the SDK treats as a failed turn (response.incomplete)
        tool_use_behavior="stop_on_first_tool",
    )
    result = agents.Runner.run_sync(agent, "Responses: the weather?", max_turns=3)
    assert len(calls) == 1 and calls[0] in ("Paris", "Oslo")
    outputs = [item for item in result.new_items if item.type == "tool_call_output_item"]
    assert [item.output for item in outputs] == ["sunny"]
    assert result.final_output == "sunny"
    # the Responses model ran it: its responses have ids (the chat model's have none)
    assert all(r.response_id.startswith("resp_") for r in result.raw_responses)


REFUSED = [
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"made_up": 1}, "made_up"),
    ({"input": []}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"text": {"format": {"type": "yaml"}}}, "text"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"store": "yes"}, "store"),
    ({"instructions": 3}, "instructions"),
]


@pytest.mark.parametrize(("extra", "param"), REFUSED, ids=[p for _, p in REFUSED])
def test_refusals_are_400s_naming_the_field(server, extra, param):
    body = {"input": QUESTION, "max_output_tokens": 2, **extra}
    resp = httpx.post(f"{server.url}/v1/responses", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_unknown_ids_are_404s_and_the_server_keeps_serving(client, server):
    for method in ("GET", "DELETE"):
        resp = httpx.request(method, f"{server.url}/v1/responses/resp_nope", timeout=30)
        assert resp.status_code == 404 and "resp_nope" in resp.json()["error"]["message"]
    resp = httpx.post(
        f"{server.url}/v1/responses",
        json={"input": "x", "previous_response_id": "resp_nope"},
        timeout=30,
    )
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "previous_response_id"
    assert create(client, max_output_tokens=2).usage.output_tokens == 2
