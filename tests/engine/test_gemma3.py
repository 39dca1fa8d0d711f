"""Gemma 3 (5 sliding-window layers + 1 global) token-exact with transformers.

Its sliding layers run in sliding-window KV cache groups of the one shared pool:
block size 4 and a window of 7 tokens, so blocks really fall out of the window
and are released while requests run.
"""

import pytest
import torch
from hybrid_rounds import MODES, tokens, two_rounds

from kvserve import LLM, SamplingParams
from kvserve.kvcache.specs import FullAttentionSpec, SlidingWindowSpec


def prompt(length, salt=0):
    gen = torch.Generator().manual_seed(9000 + 100 * salt + length)
    return torch.randint(3, 300, (length,), generator=gen).tolist()


NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
SHARED = prompt(21, salt=1)
PROMPTS = [
    prompt(3),
    prompt(8),
    [*SHARED, *prompt(6, salt=2)],
    [*SHARED, *prompt(3, salt=3)],
    list(SHARED),
    prompt(16),
    prompt(1),
]


def make(ck, **kwargs):
    options = dict(block_size=4, num_kv_blocks=160, dtype="float32", device="cpu", num_threads=1)
    options.update(kwargs)
    return LLM(ck.path, **options)


def test_runner_groups_sliding_layers_into_one_pool(gemma3_checkpoint):
    llm = make(gemma3_checkpoint)
    runner = llm.engine.runner
    specs = runner.kv_cache_specs
    assert [type(s) for s in specs] == [SlidingWindowSpec] * 5 + [FullAttentionSpec]
    assert all(s.sliding_window == 7 for s in specs[:5])
    assert runner.layer_groups.group_size == 1
    assert len(runner.kv_tensors) == 1  # every group's block ids index the same tensors
    assert all(kv is runner.kv_tensors[0] for kv in runner.kv_caches)
    assert llm.engine.manager.config.specs == specs


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_equals_transformers(gemma3_checkpoint, mode):
    options = dict(MODES[mode])
    if mode == "preempt":
        options["num_kv_blocks"] = 100
    two_rounds(make(gemma3_checkpoint, **options), gemma3_checkpoint, PROMPTS, GREEDY, mode, True)


def test_decodes_past_the_window_release_blocks(gemma3_checkpoint):
    """A long decode holds only the window's blocks in each sliding group."""
    ck = gemma3_checkpoint
    llm = make(ck)
    engine = llm.engine
    p = prompt(5, salt=4)
    engine.add_request("long", p, GREEDY)
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        req = next(iter(engine.scheduler.running), None)
        if req is not None:
            tables = engine.manager.block_ids(req.request_id)
            held.append([sum(b != 0 for b in t) for t in tables])
    assert max(max(h[:5]) for h in held) <= 3  # window 7 over blocks of 4: at most 3
    assert held[-1][5] >= (5 + NEW - 1) // 4  # the global layer keeps everything
    out = llm.generate([p], GREEDY, use_tqdm=False)
    assert tokens(out) == [ck.reference(p, NEW)]
