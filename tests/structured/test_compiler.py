"""A constraint -> xgrammar: bad ones are ValueErrors naming the field, good ones compile
once per engine on a pool of workers, kept in an LRU bounded by the compiled grammars'
bytes; a compile nobody waits for is cancelled, a wait has a deadline, and a grammar that
accepts nothing fails its compile. Real compiles on the demo tokenizer."""

from __future__ import annotations

import json
import re
import time

import pytest
import xgrammar as xgr

from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured.compiler import DEAD_END, GrammarCompiler, build_grammar, choice_ebnf
from kvserve.structured.state import GrammarState


@pytest.fixture(scope="module")
def compiler(demo_tokenizer):
    made = GrammarCompiler(demo_tokenizer, len(demo_tokenizer) + 64, {0})
    yield made
    made.close()


def enum(n: int, tag: str) -> StructuredOutputsParams:
    """A JSON enum of `n` values: 10,000 compile in about 2 s on the demo tokenizer."""
    return StructuredOutputsParams(json={"enum": [f"{tag}-{i:06d}-value" for i in range(n)]})


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
    assert isinstance(first.future.result(timeout=30), xgr.CompiledGrammar)
    other = compiler.submit(StructuredOutputsParams(regex="[0-9]+"))
    assert other is not first


def test_the_cache_is_bounded_by_bytes_least_recently_used_first(demo_tokenizer):
    made = GrammarCompiler(demo_tokenizer, len(demo_tokenizer), {0})
    try:
        size = made.submit(enum(300, "x")).future.result(timeout=30).memory_size_bytes
        assert size > 10_000  # xgrammar's own count of what it holds
        made.close()
        made = GrammarCompiler(demo_tokenizer, len(demo_tokenizer), {0}, cache_bytes=size * 5 // 2)
        a, b = made.submit(enum(300, "a")), made.submit(enum(300, "b"))
        a.future.result(timeout=30), b.future.result(timeout=30)
        time.sleep(0.1)  # the done callbacks run just after the results are set
        assert made.cached() == 2 and made.cached_bytes > size * 3 // 2
        assert made.submit(enum(300, "a")) is a  # a is now the most recent: b goes first
        c = made.submit(enum(300, "c"))
        c.future.result(timeout=30)
        time.sleep(0.1)
        assert made.cached() == 2 and made.cached_bytes <= made.cache_bytes
        assert made.submit(enum(300, "a")) is a and made.submit(enum(300, "c")) is c
        assert made.submit(enum(300, "b")) is not b  # evicted: compiled anew
    finally:
        made.close()


def test_a_grammar_that_accepts_nothing_fails_its_compile_and_is_not_kept(compiler):
    spec = StructuredOutputsParams(regex="[^\\s\\S]")  # an empty class: no character
    failed = compiler.submit(spec)
    with pytest.raises(ValueError, match=re.escape(DEAD_END)):
        failed.future.result(timeout=30)
    state = GrammarState(failed)
    with pytest.raises(ValueError, match=r"^structured_outputs: the grammar accepts no output"):
        _ = state.matcher
    time.sleep(0.1)
    assert compiler.submit(spec) is not failed


def test_a_compile_nobody_waits_for_is_cancelled_or_dropped(demo_tokenizer):
    made = GrammarCompiler(demo_tokenizer, len(demo_tokenizer), {0}, workers=1)
    try:
        slow = made.submit(enum(10_000, "slow"))
        queued = made.submit(enum(10, "queued"))
        slow_state, queued_state = GrammarState(slow), GrammarState(queued)
        queued_state.release()  # not started (one worker, busy): cancelled
        assert queued.future.cancelled() and made.cached() == 1
        slow_state.release()  # running: it cannot stop, but its result is not kept
        assert made.cached() == 0
        slow.future.result(timeout=60)
        time.sleep(0.1)
        assert made.cached() == 0 and made.cached_bytes == 0
    finally:
        made.close()


def test_a_wait_past_its_deadline_fails_naming_the_option(demo_tokenizer):
    made = GrammarCompiler(demo_tokenizer, len(demo_tokenizer), {0}, workers=2)
    try:
        slow = made.submit(enum(10_000, "late"))
        state = GrammarState(slow, timeout=0.05)
        assert not state.ready
        time.sleep(0.1)
        assert state.ready and not slow.future.done()
        with pytest.raises(ValueError, match=r"within 0.05s \(--grammar-compile-timeout\)"):
            _ = state.matcher
        # The other worker is free: a small grammar compiles while the slow one runs.
        small = made.submit(StructuredOutputsParams(choice=["yes", "no"]))
        assert small.future.result(timeout=10) is not None
        assert not slow.future.done()
    finally:
        made.close()


def test_a_state_follows_its_grammar_to_the_stop_token(compiler, demo_tokenizer):
    pending = compiler.submit(StructuredOutputsParams(choice=["yes", "no"]))
    state = GrammarState(pending)
    pending.future.result(timeout=30)
    assert state.ready
    for token in demo_tokenizer.encode("no"):
        state.accept(token)
    assert not state.terminated
    with pytest.raises(ValueError, match="not allowed"):
        state.accept(demo_tokenizer.encode("x")[0])
    state.accept(0)  # the stop token
    assert state.terminated


def test_each_state_has_its_own_matcher(compiler, demo_tokenizer):
    pending = compiler.submit(StructuredOutputsParams(regex="ab|cd"))
    pending.future.result(timeout=30)
    one, two = GrammarState(pending), GrammarState(pending)
    one.accept(demo_tokenizer.encode("a")[0])
    two.accept(demo_tokenizer.encode("c")[0])  # unaffected by what one accepted
