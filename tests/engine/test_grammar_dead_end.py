"""A grammar that reaches a dead end (no token allowed, not ended) fails its request the
same way alone and in a batch with speculative decoding: finish_reason "error", the error
naming the dead end, and no refused token in token_ids (the row fails before sampling).
A grammar that accepts nothing at all fails before any token (its compile says so)."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.sampling_params import StructuredOutputsParams

DEAD_END = 'root ::= "a" tail\ntail ::= tail "b"'
"""After "a" the grammar needs `tail`, which never ends: nothing is allowed."""
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
REPEATS = "one two three one two three one two three one two three"
ENGINE = {"block_size": 4, "num_kv_blocks": 256, "num_threads": 1, "dtype": "float32"}


def constrained(grammar: str) -> SamplingParams:
    return SamplingParams(
        temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(grammar=grammar)
    )


@pytest.fixture(scope="module")
def alone(demo_model):
    llm = LLM(demo_model, enable_prefix_caching=False, **ENGINE)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def speculative(demo_model):
    llm = LLM(demo_model, speculative_config=SPEC, **ENGINE)
    yield llm
    llm.shutdown()


def test_a_dead_end_fails_the_same_alone_and_in_a_speculative_batch(alone, speculative):
    lone = alone.generate(["Hello there"], constrained(DEAD_END), use_tqdm=False)[0]
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    batch = speculative.generate(
        [REPEATS, "Hello there", REPEATS + " one"],
        [plain, constrained(DEAD_END), plain],
        use_tqdm=False,
    )
    assert speculative.engine.drafter.stats.num_draft_tokens > 0, "nothing drafted"
    together = batch[1]
    a = alone.engine.tokenizer.encode("a")
    for output in (lone, together):
        completion = output.outputs[0]
        assert completion.finish_reason == "error"
        assert completion.token_ids == a  # "a" accepted; nothing after the dead end
        assert output.error is not None and "dead end" in output.error
    assert together.error == lone.error
    assert all(o.outputs[0].finish_reason == "length" for o in (batch[0], batch[2]))


def test_a_grammar_that_accepts_nothing_fails_before_any_token(alone, speculative):
    nothing = StructuredOutputsParams(regex="[^\\s\\S]")  # an empty class: no character
    spec = SamplingParams(temperature=0, max_tokens=8, structured_outputs=nothing)
    for llm in (alone, speculative):
        output = llm.generate(["Hello there"], spec, use_tqdm=False)[0]
        assert output.outputs[0].finish_reason == "error"
        assert output.outputs[0].token_ids == []
        assert output.error is not None and "accepts no output" in output.error
