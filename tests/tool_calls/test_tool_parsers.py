"""The hermes and llama3_json parsers: whole outputs, and the same outputs streamed in every
split (markers cut across deltas), which must join to what the whole output gives."""

from __future__ import annotations

import json

import pytest

from kvserve.tool_calls.hermes import HermesParser
from kvserve.tool_calls.llama3_json import Llama3JsonParser
from kvserve.tool_calls.registry import detect, parser_for, parser_named
from kvserve.tool_calls.stream import ToolCallStream

HERMES = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris {x}", "note": "a \\"q\\""}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
)
LLAMA = (
    'Sure: {"name": "get_weather", "parameters": {"city": "Paris {x}", "note": "a \\"q\\""}}; '
    '{"name": "get_time", "parameters": {"zone": "CET"}}'
)
WANT = [
    ("get_weather", {"city": "Paris {x}", "note": 'a "q"'}),
    ("get_time", {"zone": "CET"}),
]
CASES = [(HermesParser(), HERMES, "Let me check.\n"), (Llama3JsonParser(), LLAMA, "Sure: ")]


@pytest.mark.parametrize(("parser", "text", "content"), CASES, ids=["hermes", "llama3_json"])
def test_a_whole_output_gives_its_content_and_calls(parser, text, content):
    parsed = parser.parse(text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == WANT
    assert len({c.id for c in parsed.tool_calls}) == 2
    assert all(c.id.startswith("call_") for c in parsed.tool_calls)


@pytest.mark.parametrize(("parser", "text", "content"), CASES, ids=["hermes", "llama3_json"])
@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 11])
def test_streamed_in_any_split_it_joins_to_the_same(parser, text, content, size):
    stream = ToolCallStream(parser)
    got_content, calls = "", {}
    pieces = [stream.feed(text[i : i + size]) for i in range(0, len(text), size)]
    for piece in [*pieces, stream.finish()]:
        got_content += piece.content
        for delta in piece.calls:
            if delta.index not in calls:
                assert delta.name is not None and delta.id and delta.arguments == ""
                calls[delta.index] = [delta.name, ""]
            else:
                assert delta.name is None
                calls[delta.index][1] += delta.arguments
    assert got_content == content  # the marker and the calls never leak into the content
    assert [(n, json.loads(a)) for n, a in calls.values()] == WANT
    assert stream.called


@pytest.mark.parametrize(("parser", "text", "content"), CASES, ids=["hermes", "llama3_json"])
def test_a_long_call_streamed_a_character_at_a_time_is_read_once(parser, text, content):
    """Each delta costs what it adds: the calls' JSON is read on, never again from its start
    (re-reading it per delta made a 10 KB call cost 36 -> 483 us a delta as it grew)."""
    long_text = text.replace("Paris {x}", "Paris {x} " * 100)
    stream = ToolCallStream(parser)
    pieces = [stream.feed(c) for c in long_text]
    arguments = "".join(d.arguments for p in pieces for d in p.calls if d.index == 0)
    assert json.loads(arguments)["city"] == "Paris {x} " * 100
    assert stream.json_reads <= 2 * len(long_text)  # quadratic: about len ** 2 / 2 reads


@pytest.mark.parametrize("parser", [HermesParser(), Llama3JsonParser()], ids=lambda p: p.name)
def test_text_without_calls_is_content_even_when_it_ends_like_a_marker(parser):
    text = "no calls here <tool_ca" if parser.name == "hermes" else 'no calls {"na'
    assert parser.parse(text).content == text and parser.parse(text).tool_calls == []
    stream = ToolCallStream(parser)
    held = "".join(stream.feed(text[i : i + 3]).content for i in range(0, len(text), 3))
    assert text.startswith(held) and held != text  # the tail that may start a call waits
    assert held + stream.finish().content == text and not stream.called


def test_a_call_cut_short_is_dropped_and_the_calls_before_it_kept():
    text = 'Hi <tool_call>\n{"name": "f", "arguments": {"a": 1'
    parsed = HermesParser().parse(text)
    assert parsed.content == "Hi " and parsed.tool_calls == []
    whole = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    parsed = HermesParser().parse(f'{whole}\n{whole}\n<tool_call>\n{{"na')
    assert parsed.content is None and [c.arguments for c in parsed.tool_calls] == ['{"a": 1}'] * 2
    cut = Llama3JsonParser().parse('{"name": "f", "parameters": {}}; {"name": "g", "par')
    assert cut.content is None and [c.name for c in cut.tool_calls] == ["f"]


def test_an_empty_content_before_the_call_is_null():
    parsed = HermesParser().parse('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>')
    assert parsed.content is None and [c.arguments for c in parsed.tool_calls] == ["{}"]


def test_llama3_reads_the_python_tag_and_arguments_too():
    parsed = Llama3JsonParser().parse('<|python_tag|>{"name": "f", "arguments": {"a": 1}}')
    assert parsed.content is None
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("f", '{"a": 1}')]


def test_the_parser_follows_the_template_or_the_option():
    qwen = "{%- for tool in tools %}...<tool_call>\n{{ tool | tojson }}\n</tool_call>"
    llama = """{{- '{"name": "' + tool_call.name + '", ' }}{{- '"parameters": ' }}"""
    assert detect(qwen) == "hermes" and detect(llama) == "llama3_json"
    assert detect("{{ messages }}") is None and detect(None) is None
    assert parser_for(None, "{{ messages }}").name == "hermes"  # the default
    assert parser_for("llama3_json", qwen).name == "llama3_json"  # the option wins
    with pytest.raises(ValueError, match="no tool-call parser 'mistral'; there are hermes"):
        parser_named("mistral")
