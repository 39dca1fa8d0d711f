"""The engine's step loop over any runner: here the model-free one (no torch model)."""

from __future__ import annotations

import pytest

from kvserve.engine.engine_args import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.model_free_runner import ModelFreeRunner
from kvserve.kvcache import check_invariants
from kvserve.sampling_params import RequestOutputKind, SamplingParams

FINAL = RequestOutputKind.FINAL_ONLY


def engine(**args) -> LLMEngine:
    runner = ModelFreeRunner(num_blocks=64, hash_block_size=4)
    return LLMEngine.from_runner(runner, EngineArgs(block_size=4, **args))


def run(e: LLMEngine) -> list:
    outputs = []
    while e.has_unfinished_requests():
        outputs.append(e.step())
        held = e.scheduler.running
        check_invariants(e.manager, {r.request_id: r.num_computed_tokens for r in held})
    return outputs


def test_final_only_requests_report_once_and_cumulative_ones_every_step():
    e = engine()
    e.add_request("every", list(range(1, 10)), SamplingParams(max_tokens=5))
    e.add_request("final", list(range(1, 10)), SamplingParams(max_tokens=5, output_kind=FINAL))
    steps = run(e)
    every = [o for outs in steps for o in outs if o.request_id == "every"]
    final = [o for outs in steps for o in outs if o.request_id == "final"]
    assert len(every) == len(steps) == 5
    assert [len(o.outputs[0].token_ids) for o in every] == [1, 2, 3, 4, 5]
    assert len(final) == 1 and final[0].finished
    assert final[0].outputs[0].token_ids == every[-1].outputs[0].token_ids  # same prompt
    assert final[0].num_cached_tokens == 8  # admitted in the same step: shares 2 blocks


def test_stop_rules_live_in_the_scheduler_update():
    e = engine()
    e.add_request("probe", [7, 7, 7], SamplingParams(max_tokens=3))
    (probe,) = [o for outs in run(e) for o in outs if o.finished]
    first, second = probe.outputs[0].token_ids[:2]
    e.add_request("stopped", [7, 7, 7], SamplingParams(max_tokens=3, stop_token_ids=[second]))
    (done,) = [o for outs in run(e) for o in outs if o.finished]
    c = done.outputs[0]
    assert (c.token_ids, c.finish_reason, c.stop_reason) == ([first, second], "stop", second)


def test_a_bad_output_kind_names_the_field():
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="final")  # type: ignore[arg-type]


def test_every_finished_request_leaves_the_cache_records():
    e = engine()
    for i in range(4):
        e.add_request(f"r{i}", [i + 1] * 9, SamplingParams(max_tokens=3, output_kind=FINAL))
    e.add_request("gone", [9] * 9, SamplingParams(max_tokens=3))
    e.abort_request("gone")
    run(e)
    assert e.manager.sequences() == [] and e.manager.pool.num_used == 0
