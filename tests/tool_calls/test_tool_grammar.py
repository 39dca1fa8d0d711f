"""The grammar a tool request builds, checked on strings with xgrammar (no model): what it
accepts is a call the parser reads back, in its own format; what it refuses never parses
as a valid call. `auto` is free until the trigger; `required` and named calls are forced."""

from __future__ import annotations

import re

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured.tags import as_format
from kvserve.tool_calls.hermes import HermesParser
from kvserve.tool_calls.llama3_json import Llama3JsonParser
from kvserve.tool_calls.parser import ToolParser
from kvserve.tool_calls.request import ToolRequest, tool_request

ZONE = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_time", "parameters": ZONE}},
    {"type": "function", "function": {"name": "ping"}},  # no parameters: any object
]


def accepts(request: ToolRequest, parser: ToolParser, text: str) -> bool:
    constraint = request.constraint(parser)
    assert constraint is not None and constraint.structural_tag is not None
    grammar = xgr.Grammar.from_structural_tag(constraint.structural_tag)
    return _is_grammar_accept_string(grammar, text)


def call(parser: ToolParser, name: str, arguments: str) -> str:
    if isinstance(parser, HermesParser):
        return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'
    return f'{{"name": "{name}", "parameters": {arguments}}}'


PARSERS = [HermesParser(), Llama3JsonParser()]


@pytest.mark.parametrize("parser", PARSERS, ids=lambda p: p.name)
def test_a_named_function_is_forced_and_read_back(parser):
    request = tool_request(TOOLS, {"type": "function", "function": {"name": "get_time"}}, None)
    assert request is not None
    good = call(parser, "get_time", '{"zone": "CET"}')
    assert accepts(request, parser, good)
    parsed = parser.parse(good)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("get_time", '{"zone": "CET"}')]
    assert not accepts(request, parser, call(parser, "get_time", '{"zone": "PST"}'))
    assert not accepts(request, parser, call(parser, "ping", "{}"))
    assert not accepts(request, parser, "Sure. " + good)  # forced: no text first
    assert not accepts(request, parser, good + parser.separator + good)  # exactly one


@pytest.mark.parametrize("parser", PARSERS, ids=lambda p: p.name)
def test_required_takes_one_call_or_more_unless_not_parallel(parser):
    first, second = call(parser, "get_time", '{"zone": "UTC"}'), call(parser, "ping", '{"a": 1}')
    both = first + parser.separator + second
    parallel = tool_request(TOOLS, "required", None)
    single = tool_request(TOOLS, "required", False)
    assert parallel is not None and single is not None
    assert accepts(parallel, parser, first) and accepts(parallel, parser, both)
    assert [c.name for c in parser.parse(both).tool_calls] == ["get_time", "ping"]
    assert not accepts(parallel, parser, "")  # at least one
    assert not accepts(parallel, parser, "I would rather talk.")
    assert accepts(single, parser, first) and not accepts(single, parser, both)


@pytest.mark.parametrize("parser", PARSERS, ids=lambda p: p.name)
def test_auto_is_free_until_the_trigger_then_holds_the_call(parser):
    request = tool_request(TOOLS, "auto", False)
    assert request is not None
    good = call(parser, "get_time", '{"zone": "CET"}')
    assert accepts(request, parser, "Just text, no call at all.")
    assert accepts(request, parser, "Let me look. " + good)
    assert parser.parse("Let me look. " + good).content == "Let me look. "
    assert not accepts(request, parser, "Let me look. " + call(parser, "get_time", '{"zone": 1}'))
    assert not accepts(request, parser, "Look. " + call(parser, "nope", "{}"))
    assert not accepts(request, parser, good + " and more")  # parallel_tool_calls: false


def test_none_and_no_tools_ask_for_nothing():
    assert tool_request(None, None, None) is None and tool_request([], "auto", None) is None
    request = tool_request(TOOLS, "none", None)
    assert request is not None and not request.parses and request.template_tools is None
    assert request.constraint(HermesParser()) is None


@pytest.mark.parametrize(
    ("tools", "choice", "says"),
    [
        ([TOOLS[0], TOOLS[0]], None, "tools[1].function.name 'get_time' is given twice"),
        ([{"type": "function", "function": {"name": "a b"}}], None, "tools[0].function.name"),
        ([{"type": "code_interpreter"}], None, "tools[0] must be"),
        (TOOLS, {"type": "function", "function": {}}, "tool_choice must be"),
        (TOOLS, {"type": "function", "function": {"name": "x"}}, "tool_choice names 'x'"),
    ],
)
def test_bad_tool_fields_name_themselves(tools, choice, says):
    with pytest.raises(ValueError, match="^" + re.escape(says)):
        tool_request(tools, choice, None)


@pytest.mark.parametrize("parser", PARSERS, ids=lambda p: p.name)
def test_auto_with_an_answer_format_is_calls_or_that_answer(parser):
    request = tool_request(TOOLS, "auto", None)
    assert request is not None
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    answer = as_format(StructuredOutputsParams(json=schema))
    constraint = request.constraint(parser, answer)
    assert constraint is not None and constraint.structural_tag is not None
    grammar = xgr.Grammar.from_structural_tag(constraint.structural_tag)
    assert _is_grammar_accept_string(grammar, call(parser, "get_time", '{"zone": "UTC"}'))
    assert _is_grammar_accept_string(grammar, '{"ok": true}')
    assert not _is_grammar_accept_string(grammar, '{"no": true}')
    assert not _is_grammar_accept_string(grammar, "free text")
