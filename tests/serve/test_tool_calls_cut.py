"""A forced tool-call answer cut by max_tokens, through real clients against a real server:
its complete calls always come back parsed, the call cut short is dropped (a stream has
already sent its start: it stays as sent), no `<tool_call>` markup ever reaches the
content, and the finish reason says it was cut (chat "length", Responses "incomplete",
Messages "max_tokens"). Anthropic's `disable_parallel_tool_use` means chat's
`parallel_tool_calls: false`."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import openai
import pytest
from _tool_checkpoint import TOOL_MODEL

from kvserve.serve.messages_api.request import translate
from tests.serve.test_tool_calls import ASK, TOOLS, TRIGGER_TOKEN, streamed

MARKUP = "<tool_call>"
NEWLINE = 201
"""The separator between two calls, in the demo tokenizer (`\\n`)."""
BIAS = {str(TRIGGER_TOKEN): 100, str(NEWLINE): 100}
"""After each call the model starts another (a newline, then `<tool_call>`): calls until cut
(inside a call the grammar allows no newline: compact JSON)."""
LONGEST = 220
CUTS = range(7, LONGEST, 37)
"""max_tokens values across the first calls (about 50 tokens each) and the cuts between."""


@pytest.fixture(scope="module")
def openai_client(tool_server):
    with openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key="unused", timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def claude(tool_server):
    with anthropic.Anthropic(base_url=tool_server.url, api_key="unused", timeout=60) as c:
        yield c


def chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    args = {"model": TOOL_MODEL, "messages": ASK, "tools": TOOLS, "temperature": 0}
    return client.chat.completions.create(**{**args, "tool_choice": "required", **kwargs})


def pairs(calls: list[Any]) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in calls or []]


@pytest.mark.slow
def test_chat_keeps_every_complete_call_of_a_cut_answer(openai_client):
    longest = chat(openai_client, max_tokens=LONGEST, logit_bias=BIAS).choices[0]
    every = pairs(longest.message.tool_calls)
    assert longest.finish_reason == "length" and len(every) >= 2, "the test needs 2+ calls"
    seen = set()
    for cut in CUTS:
        choice = chat(openai_client, max_tokens=cut, logit_bias=BIAS).choices[0]
        calls = pairs(choice.message.tool_calls)
        assert choice.finish_reason == "length"
        assert choice.message.content is None  # never the markup of the call cut short
        assert calls == every[: len(calls)]  # whole calls, in order, the cut one dropped
        for name, arguments in calls:
            assert name in ("get_weather", "get_time") and isinstance(json.loads(arguments), dict)
        seen.add(len(calls))
        content, pieces, finish, _ = streamed(
            openai_client, tool_choice="required", max_tokens=cut, logit_bias=BIAS
        )
        assert finish == "length" and content == ""
        sent = [(p["name"], p["args"]) for p in pieces]
        whole = [(name, json.dumps(json.loads(args))) for name, args in sent[: len(calls)]]
        assert whole == calls  # the stream's complete calls are the same calls
        assert len(sent) <= len(calls) + 1  # and at most the cut one, as far as it was sent
    assert 0 in seen and len(seen) >= 3, f"the cuts did not fall between calls: {seen}"


def test_responses_and_messages_drop_the_cut_call(openai_client, claude):
    tool = {**TOOLS[0]["function"], "type": "function"}
    whole = openai_client.responses.create(
        model=TOOL_MODEL, input=ASK[0]["content"], tools=[tool], tool_choice="required",
        max_output_tokens=200, temperature=0,
    )  # fmt: skip
    calls = [item for item in whole.output if item.type == "function_call"]
    assert whole.status == "completed" and len(calls) >= 1
    anthropic_tool = {"name": tool["name"], "input_schema": tool["parameters"]}
    for cut in (4, 12, 20):
        got = openai_client.responses.create(
            model=TOOL_MODEL, input=ASK[0]["content"], tools=[tool], tool_choice="required",
            max_output_tokens=cut, temperature=0,
        )  # fmt: skip
        assert got.status == "incomplete"
        assert got.incomplete_details.reason == "max_output_tokens"
        assert MARKUP not in (got.output_text or "")
        assert all(item.type != "function_call" for item in got.output)  # cut: dropped
        message = claude.messages.create(
            model=TOOL_MODEL, max_tokens=cut, tools=[anthropic_tool], tool_choice={"type": "any"},
            messages=ASK, extra_body={"temperature": 0},
        )  # fmt: skip
        assert message.stop_reason == "max_tokens"
        assert all(block.type != "tool_use" for block in message.content)
        assert all(MARKUP not in block.text for block in message.content if block.type == "text")


def test_disable_parallel_tool_use_is_parallel_tool_calls_false(openai_client, claude):
    for kind in ("any", "auto", "tool"):
        choice = {"type": kind, "disable_parallel_tool_use": True}
        if kind == "tool":
            choice["name"] = "get_time"
        body = {"max_tokens": 8, "messages": ASK, "tool_choice": choice}
        assert translate(body)[0]["parallel_tool_calls"] is False
        assert (
            "parallel_tool_calls"
            not in translate(
                {
                    **body,
                    "tool_choice": {
                        "type": kind,
                        **({"name": "get_time"} if kind == "tool" else {}),
                    },
                }
            )[0]
        )
    anthropic_tools = [
        {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS
    ]
    message = claude.messages.create(
        model=TOOL_MODEL, max_tokens=200, tools=anthropic_tools, messages=ASK,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body={"temperature": 0},
    )  # fmt: skip
    uses = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and len(uses) == 1
    single = chat(openai_client, max_tokens=200, parallel_tool_calls=False).choices[0]
    assert [(u.name, u.input) for u in uses] == [
        (c.function.name, json.loads(c.function.arguments)) for c in single.message.tool_calls
    ]
    with pytest.raises(anthropic.BadRequestError, match="disable_parallel_tool_use"):
        claude.messages.create(
            model=TOOL_MODEL, max_tokens=8, tools=anthropic_tools, messages=ASK,
            tool_choice={"type": "any", "disable_parallel_tool_use": "yes"},
        )  # fmt: skip
