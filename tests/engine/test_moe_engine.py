"""Mixture-of-experts models through the engine, token-exact with transformers (float32).

Qwen3-MoE, Mixtral and OLMoE (tests/model/moe_checkpoints.py) with prefix caching on
and off, and under preemption with chunked prefill: two rounds of the same prompts
(the second hits the cache where it is on), every token transformers' greedy one.
The CPU tier and KV events with Qwen3-MoE. test_device_oracle.py runs the same
prompts on a GPU, on the plain and the Triton attention backends.
"""

import pytest
import torch
from hybrid_rounds import tokens, two_rounds

from kvserve import LLM, SamplingParams
from tests._ports import free_port
from tests.model.moe_checkpoints import MOE_ARCHS


def prompt(length, salt=0):
    gen = torch.Generator().manual_seed(8000 + 100 * salt + length)
    return torch.randint(3, 300, (length,), generator=gen).tolist()


NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
SHARED = prompt(13, salt=1)
PROMPTS = [prompt(3), [*SHARED, *prompt(6, salt=2)], [*SHARED, *prompt(3, salt=3)], prompt(17)]
PREEMPT_BLOCKS = 12
"""A pool too small for the four prompts at once: two_rounds asserts preemptions."""
MODES = {
    "cached": {},
    "no-cache": {"enable_prefix_caching": False},
    "preempt-chunked": {"num_kv_blocks": PREEMPT_BLOCKS, "max_num_batched_tokens": 7},
}


def make(ck, **kwargs):
    options = dict(block_size=4, num_kv_blocks=64, dtype="float32", device="cpu", num_threads=1)
    options.update(kwargs)
    return LLM(ck.path, **options)


@pytest.fixture(params=sorted(MOE_ARCHS))
def checkpoint(request, moe_checkpoints):
    return moe_checkpoints[request.param]


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_equals_transformers(checkpoint, mode):
    llm = make(checkpoint, **MODES[mode])
    two_rounds(llm, checkpoint, PROMPTS, GREEDY, mode.removesuffix("-chunked"), True)


def test_outputs_are_not_degenerate(checkpoint):
    """The oracle only means something if the reference does not repeat one token."""
    assert len(set(tokens(make(checkpoint).generate([PROMPTS[1]], GREEDY, use_tqdm=False))[0])) > 3


def test_cpu_tier_and_kv_events(moe_checkpoints):
    """A pool that the second round finds emptied: its hits come from the CPU tier, the
    tokens stay transformers', and the steps publish their KV events."""
    ck = moe_checkpoints["qwen3_moe"]
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{free_port()}"}
    llm = make(ck, num_kv_blocks=16, offload="cpu:16MiB", kv_events_config=events)
    expected = [ck.reference(p, NEW) for p in PROMPTS]
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
    flush = [prompt(40, salt=9 + i) for i in range(2)]  # evicts the first round's blocks
    llm.generate(flush, GREEDY, use_tqdm=False)
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
    stats = llm.stats()
    assert stats["external_hit_tokens"] > 0 and stats["offload_bytes_loaded"] > 0
    assert llm.engine.kv_events is not None
    assert llm.engine.kv_events.publisher.last_seq > 0
    llm.shutdown()
