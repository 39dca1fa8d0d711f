"""A constraint -> xgrammar: bad ones are ValueErrors naming the field, good ones compile
once per engine (an LRU of futures), choices are exact literals."""

from __future__ import annotations

import json
import re

import pytest
import xgrammar as xgr

from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured import compiler as compiler_module
from kvserve.structured.compiler import GrammarCompiler, build_grammar, choice_ebnf
from kvserve.structured.state import GrammarState


@pytest.fixture(scope="module")
def compiler(demo_tokenizer):
    made = GrammarCompiler(demo_tokenizer, len(demo_tokenizer) + 64, {0})
    yield made
    made.close()


@pytest.mark.parametrize(
    ("kind", "text", "message"),
    [
        ("json", '{"type": "nosuch"}', r'structured_outputs\.json: Unsupported type "nosuch"'),
        ("json", "{not json", r"structured_outputs\.json is not valid JSON"),
        ("json", "[1, 2]", r"structured_outputs\.json must be a JSON schema"),
        ("regex", "a(b", r"structured_outputs\.regex: .*parenthesis"),
        ("grammar", "root ::= foo", r'structured_outputs\.grammar: .*"foo" is not defined'),
    ],
)
def test_a_constraint_xgrammar_cannot_read_is_a_value_error_naming_it(kind, text, message):
    with pytest.raises(ValueError, match=message) as caught:
        build_grammar(kind, text)
    assert "/project/" not in str(caught.value) and "\n" not in str(caught.value)


def test_choices_are_exact_literals_quotes_and_all():
    choices = ['say "hi"', "back\\slash", "naïve", "two\nlines", ""]
    grammar = xgr.Grammar.from_ebnf(choice_ebnf(choices))
    assert "root" in str(grammar)
    assert choice_ebnf(["a", "b"]) == 'root ::= "a" | "b"'


def test_a_repeated_constraint_compiles_once(compiler):
    spec = StructuredOutputsParams(
        json={"type": "object", "properties": {"x": {"type": "integer"}}}
    )
    first = compiler.submit(spec)
    again = compiler.submit(StructuredOutputsParams(json=json.dumps(spec.json)))
    assert again is first
    assert isinstance(first.result(timeout=30), xgr.CompiledGrammar)
    other = compiler.submit(StructuredOutputsParams(regex="[0-9]+"))
    assert other is not first


def test_the_cache_drops_the_least_recently_used(compiler, monkeypatch):
    monkeypatch.setattr(compiler_module, "CACHE_SIZE", 2)
    a, b, c = (StructuredOutputsParams(regex=f"{x}+") for x in "abc")
    fa = compiler.submit(a)
    compiler.submit(b)
    assert compiler.submit(a) is fa  # a is now the most recent
    compiler.submit(c)  # evicts b
    assert compiler.submit(a) is fa
    assert compiler.submit(b) is not None and len(compiler._cache) == 2


def test_a_failed_compile_is_not_kept(compiler, monkeypatch):
    spec = StructuredOutputsParams(regex="q+")
    monkeypatch.setattr(compiler, "_compile", lambda grammar: 1 / 0)
    failed = compiler.submit(spec)
    with pytest.raises(ZeroDivisionError):
        failed.result(timeout=30)
    monkeypatch.undo()
    assert compiler.submit(spec).result(timeout=30) is not None


def test_a_state_follows_its_grammar_to_the_stop_token(compiler, demo_tokenizer):
    future = compiler.submit(StructuredOutputsParams(choice=["yes", "no"]))
    state = GrammarState(future)
    future.result(timeout=30)
    assert state.ready
    for token in demo_tokenizer.encode("no"):
        state.accept(token)
    assert not state.terminated
    with pytest.raises(ValueError, match="not allowed"):
        state.accept(demo_tokenizer.encode("x")[0])
    state.accept(0)  # the stop token
    assert state.terminated


def test_each_state_has_its_own_matcher(compiler, demo_tokenizer):
    future = compiler.submit(StructuredOutputsParams(regex="ab|cd"))
    future.result(timeout=30)
    one, two = GrammarState(future), GrammarState(future)
    one.accept(demo_tokenizer.encode("a")[0])
    two.accept(demo_tokenizer.encode("c")[0])  # unaffected by what one accepted
    assert re.fullmatch("ab|cd", "cd")
