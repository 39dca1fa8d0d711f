"""Constrained answers are the scheduler's business only for when they run: batching with
plain rows, preemption, chunked prefill, prefix hits and a compile still under way never
change a token; padded vocabulary columns are masked too (demo checkpoint)."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import Future
from pathlib import Path

import jsonschema
import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve import LLM, SamplingParams
from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured.compiler import Pending

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 12},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["title", "count", "tags"],
    "additionalProperties": False,
}
LONG = "The harbour lights came on one by one while the boats drifted home. " * 3
PROMPTS = [LONG + "Answer:", "Hello there", LONG + "Again:", "tell me", "Once upon a time"]
JSON = SamplingParams(
    temperature=0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=SCHEMA)
)
PLAIN = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def make(model: str, **options) -> LLM:
    settings = dict(block_size=4, num_kv_blocks=512, num_threads=1)
    settings.update(options)
    return LLM(model, **settings)


def answers(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


@pytest.fixture(scope="module")
def reference(demo_model):
    """Each prompt's constrained answer, generated alone on a roomy engine."""
    llm = make(demo_model)
    return [answers(llm.generate([p], JSON, use_tqdm=False))[0] for p in PROMPTS]


def test_the_reference_answers_validate(reference, demo_tokenizer):
    for ids in reference:
        jsonschema.validate(json.loads(demo_tokenizer.decode(ids[:-1])), SCHEMA)


def test_plain_rows_beside_constrained_ones_keep_their_greedy_tokens(demo_model, reference):
    llm = make(demo_model)
    plain = answers(llm.generate(PROMPTS, PLAIN, use_tqdm=False))
    mixed_params = [JSON if i % 2 else PLAIN for i in range(len(PROMPTS))]
    mixed = answers(llm.generate(PROMPTS, mixed_params, use_tqdm=False))
    for i, ids in enumerate(mixed):
        assert ids == (reference[i] if i % 2 else plain[i])


@pytest.mark.parametrize(
    "options",
    [
        {"num_kv_blocks": 40, "max_num_seqs": 5},  # preemption and recompute mid-answer
        {"max_num_batched_tokens": 7},  # chunked prefill beside constrained decodes
        {"enable_prefix_caching": False},
    ],
    ids=["preempt", "chunked", "no-cache"],
)
def test_scheduling_never_changes_a_constrained_answer(demo_model, reference, options):
    llm = make(demo_model, **options)
    assert answers(llm.generate(PROMPTS, JSON, use_tqdm=False)) == reference
    if "num_kv_blocks" in options:
        assert llm.stats()["preemptions"] > 0


def test_a_prefix_hit_gives_the_same_constrained_answer(demo_model, reference):
    llm = make(demo_model)
    first = llm.generate([PROMPTS[0]], JSON, use_tqdm=False)
    again = llm.generate([PROMPTS[2]], JSON, use_tqdm=False)  # shares LONG with the first
    assert again[0].num_cached_tokens > 0
    assert answers(first + again) == [reference[0], reference[2]]


def test_answers_loaded_back_from_the_cpu_tier_are_the_same(demo_model, reference):
    llm = make(demo_model, num_kv_blocks=48, max_num_seqs=2, offload="cpu:64MiB")
    for _ in range(2):  # the second round's prompts come back from the tier
        assert answers(llm.generate(PROMPTS, JSON, use_tqdm=False)) == reference
    assert llm.stats()["external_hit_tokens"] > 0


def test_a_request_whose_grammar_compiles_waits_while_others_run(demo_model, reference):
    llm = make(demo_model)
    engine = llm.engine
    compiled = engine.grammars.states_for(JSON)().future.result()  # the real compile, done
    held: Future = Future()
    compiler = engine.grammars.compiler
    real_submit = compiler.submit
    compiler.submit = lambda spec: Pending(spec.key, held)
    try:
        engine.add_request("c", PROMPTS[1], JSON)
    finally:
        compiler.submit = real_submit
    engine.add_request("p", PROMPTS[3], PLAIN)
    progress: dict[str, list[int]] = {}
    for _ in range(5):
        for out in engine.step():
            progress[out.request_id] = out.outputs[0].token_ids
    assert len(progress["p"]) == 5 and "c" not in progress
    held.set_result(compiled)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert done["c"] == reference[1]


def test_a_compile_that_fails_fails_its_request_alone(demo_model):
    llm = make(demo_model)
    engine = llm.engine
    engine.grammars.states_for(JSON)  # the compiler exists
    broken: Future = Future()
    broken.set_exception(RuntimeError("compile blew up"))
    compiler = engine.grammars.compiler
    real_submit = compiler.submit
    compiler.submit = lambda spec: Pending(spec.key, broken)
    try:
        engine.add_request("c", PROMPTS[1], JSON)
    finally:
        compiler.submit = real_submit
    engine.add_request("p", PROMPTS[3], PLAIN)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["c"].outputs[0].finish_reason == "error"
    assert "compile blew up" in finished["c"].error
    assert len(finished["p"].outputs[0].token_ids) == PLAIN.max_tokens


def held_request(engine, future: Future, rid: str = "c") -> None:
    """`rid` added with the JSON constraint, its compile `future` (set by the test)."""
    engine.grammars.states_for(JSON)  # the compiler exists
    compiler = engine.grammars.compiler
    real_submit = compiler.submit
    compiler.submit = lambda spec: Pending(spec.key, future)
    try:
        engine.add_request(rid, LONG, JSON)
    finally:
        compiler.submit = real_submit


def run_alone(engine) -> dict:
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


@pytest.mark.parametrize("how", ["failed", "timed-out"])
def test_a_failed_compile_fails_its_request_before_any_block_or_prefill(demo_model, how):
    """Its grammar can never give it a token: it fails when it would be admitted, with the
    error a failed row gave (the server's 400), and never takes a KV block or a prefill."""
    llm = make(demo_model, grammar_compile_timeout=0.3)
    future: Future = Future()  # timed out: never done
    if how == "failed":
        future.set_exception(RuntimeError("compile blew up"))
    held_request(llm.engine, future)
    finished = run_alone(llm.engine)
    assert finished["c"].outputs[0].finish_reason == "error"
    said = {"failed": "failed to compile: compile blew up", "timed-out": "within 0.3s"}[how]
    assert finished["c"].error.startswith("ValueError: structured_outputs: the grammar")
    assert said in finished["c"].error
    stats = llm.stats()
    assert stats["prefill_tokens_computed"] == 0 and stats["peak_blocks_used"] == 0
    llm.generate(["tell me"], PLAIN)  # the engine goes on


@pytest.fixture(scope="module")
def padded_model(demo_model, tmp_path_factory) -> str:
    """The demo checkpoint with 64 padding rows in its (tied) embeddings, made loud: a plain
    greedy run picks padding tokens, which no tokenizer can decode."""
    path = tmp_path_factory.mktemp("padded") / "model"
    shutil.copytree(demo_model, path)
    weights = load_file(path / "model.safetensors")
    embed = weights["model.embed_tokens.weight"]
    loud = 8 * embed[torch.randperm(embed.shape[0], generator=torch.Generator().manual_seed(3))]
    weights["model.embed_tokens.weight"] = torch.cat([embed, loud[:64]]).contiguous()
    save_file(weights, path / "model.safetensors")
    config = json.loads(Path(path / "config.json").read_text())
    config["vocab_size"] = embed.shape[0] + 64
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_padding_columns_past_the_tokenizer_are_masked(padded_model, demo_tokenizer):
    llm = make(padded_model)
    vocab = len(demo_tokenizer)
    plain = answers(llm.generate(PROMPTS, PLAIN, use_tqdm=False))
    assert any(t >= vocab for ids in plain for t in ids)  # the padding would be picked
    for ids in answers(llm.generate(PROMPTS, JSON, use_tqdm=False)):
        assert max(ids) < vocab
        jsonschema.validate(json.loads(demo_tokenizer.decode(ids[:-1])), SCHEMA)
