"""Pooling requests in the engine: prefill only, chunked and preempted like any prompt, and
still transformers' final hidden states pooled (last token, or the mean of all)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvserve import LLM, SamplingParams
from kvserve.model.demo import ensure_demo_model
from kvserve.pooling_params import PoolingParams

PROMPTS = [
    "Blocks of four tokens, chunks of eight, and a pool too small for all of us at once.",
    "A second prompt, about as long as the first one, so that the two of them compete.",
    "The third and last prompt of the batch: it waits, or pushes another one out.",
]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> str:
    return ensure_demo_model(tmp_path_factory.mktemp("pooling-demo"))


@pytest.mark.parametrize("rule", ["last", "mean"])
def test_chunked_and_preempted_pooling_equals_transformers(demo: str, rule: str):
    llm = LLM(demo, block_size=4, num_kv_blocks=12, max_num_batched_tokens=8, num_threads=1)
    model = AutoModelForCausalLM.from_pretrained(demo, dtype=torch.float32).eval()
    engine = llm.engine
    try:
        engine.add_request("story", "Once upon a time", SamplingParams(max_tokens=6))
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"embed-{i}", prompt, PoolingParams(rule))
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        assert llm.stats()["preemptions"] > 0  # the pool was too small for all of them
        assert len(done["story"].outputs[0].token_ids) == 6  # generation went on beside
        for i in range(len(PROMPTS)):
            out = done[f"embed-{i}"]
            assert out.outputs[0].token_ids == [] and out.error is None
            with torch.no_grad():
                hidden = model.model(torch.tensor([out.prompt_token_ids])).last_hidden_state[0]
            pooled = hidden[-1] if rule == "last" else hidden.mean(dim=0)
            want = torch.nn.functional.normalize(pooled, dim=0)
            assert out.embedding is not None
            assert (torch.tensor(out.embedding) - want).abs().max() <= 1e-5
    finally:
        llm.shutdown()


def test_a_pooling_request_samples_nothing_and_bad_params_are_refused(demo: str):
    with pytest.raises(ValueError, match="pooling must be one of"):
        PoolingParams("max")
    llm = LLM(demo, block_size=4, num_kv_blocks=64, num_threads=1)
    try:
        out = llm.embed([[5, 6, 7]], use_tqdm=False)[0]
        assert out.prompt_token_ids == [5, 6, 7] and llm.stats()["generated_tokens"] == 0
        with pytest.raises(ValueError, match="prompt 0"):
            llm.embed([[]], use_tqdm=False)
    finally:
        llm.shutdown()
