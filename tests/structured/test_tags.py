"""Structural tags built as plain data (kvserve.structured.tags), read by xgrammar: each
constraint as a format, composed after free text and a marker (what tool calls and a
reasoning block before a schema both need)."""

from __future__ import annotations

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured import tags


def accepts(format: tags.Format, text: str) -> bool:
    grammar = xgr.Grammar.from_structural_tag(tags.structural_tag(format))
    return _is_grammar_accept_string(grammar, text)


@pytest.mark.parametrize(
    ("spec", "good", "bad"),
    [
        (StructuredOutputsParams(json='{"type": "integer"}'), "42", '"42"'),
        (StructuredOutputsParams(json_object=True), '{"a": [1]}', "[1]"),
        (StructuredOutputsParams(regex=r"[ab]{2}"), "ab", "abc"),
        (StructuredOutputsParams(choice=["yes", "no"]), "no", "maybe"),
        (StructuredOutputsParams(grammar='root ::= "x" "y"*'), "xyy", "yx"),
    ],
    ids=["json", "json_object", "regex", "choice", "grammar"],
)
def test_each_constraint_as_a_format_after_a_reasoning_block(spec, good, bad):
    think = tags.tag("<think>", tags.any_text(), "</think>")
    format = tags.sequence(think, tags.as_format(spec))
    assert accepts(format, f"<think>let me see</think>{good}")
    assert not accepts(format, f"<think>let me see</think>{bad}")
    assert not accepts(format, good)  # the block comes first


def test_free_text_until_a_trigger_then_the_tag():
    format = tags.free_text_then_tags(
        ["<x>"], [tags.tag("<x>", tags.json_schema({"type": "integer"}), "</x>")]
    )
    assert accepts(format, "anything at all")
    assert accepts(format, "then <x>7</x> and on")
    assert not accepts(format, "then <x>seven</x>")


def test_a_json_schema_given_as_text_must_be_json():
    with pytest.raises(ValueError, match=r"structured_outputs\.json is not valid JSON"):
        tags.as_format(StructuredOutputsParams(json="{nope"))
