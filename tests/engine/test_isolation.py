"""One request's fault fails that request alone (design.md invariant 11): a row whose
sampling raises, a stop check that raises; the other rows' greedy tokens are unchanged."""

from __future__ import annotations

import pytest

from kvserve.engine.engine_args import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.model_free_runner import ModelFreeRunner
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import RequestOutputKind, SamplingParams

FINAL = RequestOutputKind.FINAL_ONLY
PROMPTS = {"a": [5, 6, 7, 8, 9], "b": [11, 12, 13], "c": [21, 22, 23, 24, 25, 26, 27]}


@pytest.fixture(scope="module")
def engine(demo_model: str) -> LLMEngine:
    e = LLMEngine(demo_model, EngineArgs(block_size=4, num_threads=1, num_kv_blocks=128))
    yield e
    e.shutdown()


def greedy(max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, output_kind=FINAL)


def finish(e: LLMEngine) -> dict[str, RequestOutput]:
    done = {}
    while e.has_unfinished_requests():
        for output in e.step():
            if output.finished:
                done[output.request_id] = output
    assert e.manager.sequences() == [] and e.manager.pool.num_used == 0
    return done


def alone(e: LLMEngine) -> dict[str, list[int]]:
    tokens = {}
    for rid, prompt in PROMPTS.items():
        e.add_request(rid, prompt, greedy())
        tokens[rid] = finish(e)[rid].outputs[0].token_ids
    return tokens


def test_a_seed_the_generator_refuses_fails_its_request_alone(engine):
    expected = alone(engine)
    bad = SamplingParams(temperature=1.0, max_tokens=6, seed=1, output_kind=FINAL)
    bad.seed = 2**70  # past validation: what a door that let it through would hand on
    engine.add_request("a", PROMPTS["a"], greedy())
    engine.add_request("bad", [3, 4, 5], bad)
    engine.add_request("b", PROMPTS["b"], greedy())
    engine.add_request("c", PROMPTS["c"], greedy())
    done = finish(engine)
    assert {rid: done[rid].outputs[0].token_ids for rid in PROMPTS} == expected
    assert done["bad"].error and "overflow" in done["bad"].error.lower()
    assert done["bad"].outputs[0].finish_reason == "error"
    assert all(done[rid].error is None for rid in PROMPTS)


def test_an_injected_fault_in_one_row_of_a_decode_step(engine, monkeypatch):
    """The fault strikes mid-generation (the 3rd token), in a request with n=2: both of
    its completions end, the other requests' tokens are those they get alone."""
    import kvserve.model.runner as runner_module

    expected = alone(engine)
    real = runner_module.apply_penalties

    def faulty(logits, chunks):
        for chunk in chunks:
            if chunk.request_id.startswith("bad") and chunk.num_generated == 2:
                raise RuntimeError("injected fault")
        return real(logits, chunks)

    monkeypatch.setattr(runner_module, "apply_penalties", faulty)
    engine.add_request("a", PROMPTS["a"], greedy())
    engine.add_request("bad", [3, 4, 5], SamplingParams(n=2, max_tokens=6, output_kind=FINAL))
    engine.add_request("b", PROMPTS["b"], greedy())
    engine.add_request("c", PROMPTS["c"], greedy())
    done = finish(engine)
    assert {rid: done[rid].outputs[0].token_ids for rid in PROMPTS} == expected
    assert done["bad"].error == "RuntimeError: injected fault"
    assert sorted(c.finish_reason for c in done["bad"].outputs) in (
        ["abort", "error"],
        ["error", "error"],
    )
    monkeypatch.undo()
    assert alone(engine) == expected  # and the engine goes on as before


def test_a_stop_check_that_raises_fails_its_request_alone(monkeypatch):
    e = LLMEngine.from_runner(
        ModelFreeRunner(num_blocks=64, hash_block_size=4), EngineArgs(block_size=4)
    )
    real = e.scheduler.stop_checker.check

    def check(request, token):
        if request.request_id == "bad":
            raise KeyError("injected")
        return real(request, token)

    monkeypatch.setattr(e.scheduler.stop_checker, "check", check)
    e.add_request("ok", [1, 2, 3], greedy(4))
    e.add_request("bad", [1, 2, 3], greedy(4))
    done = finish(e)
    assert done["bad"].error == "KeyError: 'injected'"
    assert len(done["ok"].outputs[0].token_ids) == 4 and done["ok"].error is None


def test_n_is_bounded_by_what_the_engine_runs_at_once():
    e = LLMEngine.from_runner(
        ModelFreeRunner(num_blocks=64, hash_block_size=4), EngineArgs(block_size=4, max_num_seqs=8)
    )
    with pytest.raises(ValueError, match=r"n must be <= max_num_seqs \(8\)"):
        e.add_request("r", [1, 2], SamplingParams(n=10**9))
    assert not e.has_unfinished_requests()


def test_a_seed_near_the_int64_edge_gives_each_completion_a_valid_seed():
    e = LLMEngine.from_runner(
        ModelFreeRunner(num_blocks=64, hash_block_size=4), EngineArgs(block_size=4)
    )
    e.add_request("r", [1, 2], SamplingParams(n=3, seed=2**63 - 1, max_tokens=2))
    assert len(finish(e)["r"].outputs) == 3
