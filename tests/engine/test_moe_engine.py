"""Mixture-of-experts models through the engine, token-exact with transformers (float32).

Qwen3-MoE, Mixtral and OLMoE (tests/model/moe_checkpoints.py) with prefix caching on
and off, and under preemption with chunked prefill: two rounds of the same prompts
(the second hits the cache where it is on), every token transformers' greedy one.
"""

import pytest
import torch
from hybrid_rounds import tokens, two_rounds

from kvserve import LLM, SamplingParams
from tests.model.moe_checkpoints import MOE_ARCHS, moe_checkpoint


def prompt(length, salt=0):
    gen = torch.Generator().manual_seed(8000 + 100 * salt + length)
    return torch.randint(3, 300, (length,), generator=gen).tolist()


NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
SHARED = prompt(13, salt=1)
PROMPTS = [prompt(3), [*SHARED, *prompt(6, salt=2)], [*SHARED, *prompt(3, salt=3)], prompt(17)]
MODES = {
    "cached": {},
    "no-cache": {"enable_prefix_caching": False},
    # a pool too small for all four at once (two_rounds asserts preemptions), 7 tokens a step
    "preempt-chunked": {"num_kv_blocks": 12, "max_num_batched_tokens": 7},
}


@pytest.fixture(scope="module", params=sorted(MOE_ARCHS))
def checkpoint(request, tmp_path_factory):
    return moe_checkpoint(tmp_path_factory, request.param)


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_equals_transformers(checkpoint, mode):
    options = dict(block_size=4, num_kv_blocks=64, dtype="float32", device="cpu", num_threads=1)
    options.update(MODES[mode])
    llm = LLM(checkpoint.path, **options)
    two_rounds(llm, checkpoint, PROMPTS, GREEDY, mode.removesuffix("-chunked"), True)


def test_outputs_are_not_degenerate(checkpoint):
    """The oracle only means something if the reference does not repeat one token."""
    llm = LLM(checkpoint.path, block_size=4, num_kv_blocks=64, dtype="float32", num_threads=1)
    assert len(set(tokens(llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False))[0])) > 3
