"""Bamba (Mamba2 + attention) through the engine, token-exact with transformers.

Its Mamba layers keep their state in pages of the one shared pool, so the
attention blocks are inflated (here 16 hash blocks of 4 tokens = 64 tokens a
physical block) while matching stays at 4 tokens: every prompt below is
shorter than one physical block, and repeats of them still hit, by copying
the cached slots and resuming the state from a snapshot.
"""

import pytest
import torch
from hybrid_rounds import MODES, tokens, two_rounds

from kvserve import LLM, SamplingParams
from kvserve.kvcache.specs import FullAttentionSpec, MambaStateSpec


def prompt(length, salt=0):
    gen = torch.Generator().manual_seed(7000 + 100 * salt + length)
    return torch.randint(3, 300, (length,), generator=gen).tolist()


NEW = 20
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
SHARED = prompt(13, salt=1)
PROMPTS = [
    prompt(50, salt=9),  # decodes into a second physical block
    prompt(58, salt=10),
    prompt(3),
    prompt(9),
    [*SHARED, *prompt(6, salt=2)],
    [*SHARED, *prompt(3, salt=3)],
    list(SHARED),
    prompt(16),
    prompt(1),
    prompt(70, salt=4),  # longer than one physical block: a snapshot when it fills
]


def make(ck, **kwargs):
    options = dict(block_size=4, num_kv_blocks=128, dtype="float32", device="cpu", num_threads=1)
    options.update(kwargs)
    return LLM(ck.path, **options)


def test_state_layers_share_the_pool_with_inflated_attention_blocks(bamba_checkpoint):
    llm = make(bamba_checkpoint)
    runner = llm.engine.runner
    specs = runner.kv_cache_specs
    assert sorted(type(s).__name__ for s in specs) == ["FullAttentionSpec"] + ["MambaStateSpec"] * 3
    attention = next(s for s in specs if isinstance(s, FullAttentionSpec))
    state = next(s for s in specs if isinstance(s, MambaStateSpec))
    assert runner.hash_block_size == llm.engine.manager.block_size == 4
    physical = attention.block_size
    assert physical > 4 and physical % 4 == 0
    assert all(s.block_size == physical for s in specs)
    assert runner.block_size == physical
    # One page size: a state page fits the K/V page pair of one block.
    assert state.page_bytes <= attention.page_bytes


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_equals_transformers(bamba_checkpoint, mode):
    options = dict(MODES[mode])
    if mode == "preempt":
        options["num_kv_blocks"] = 14
    # (A pool of 14 blocks keeps about one snapshot per state group: hits are luck there.)
    llm = make(bamba_checkpoint, **options)
    two_rounds(llm, bamba_checkpoint, PROMPTS, GREEDY, mode, expect_hits=mode != "preempt")


def test_short_prompt_repeated_hits_inside_one_physical_block(bamba_checkpoint):
    """Seed of vLLM #43258: a prompt shorter than one inflated block still hits."""
    ck = bamba_checkpoint
    llm = make(ck)
    p = prompt(11, salt=5)
    expected = [ck.reference(p, NEW)]
    first = llm.generate([p], GREEDY, use_tqdm=False)
    assert tokens(first) == expected and first[0].num_cached_tokens == 0
    again = llm.generate([p], GREEDY, use_tqdm=False)
    assert tokens(again) == expected
    assert again[0].num_cached_tokens == (11 - 1) // 4 * 4  # the last hash-block boundary


def test_same_step_identical_prompts_wait_one_step_then_hit(bamba_checkpoint):
    ck = bamba_checkpoint
    llm = make(ck)
    p = prompt(10, salt=6)
    out = llm.generate([p, p, p], GREEDY, use_tqdm=False)
    assert tokens(out) == [ck.reference(p, NEW)] * 3
    assert [o.num_cached_tokens for o in out] == [0, 8, 8]
    assert llm.stats()["prefill_tokens_computed"] == 10 + 2 + 2


def test_next_chat_turn_resumes_from_the_previous_turn(bamba_checkpoint):
    ck = bamba_checkpoint
    llm = make(ck)
    turn1 = prompt(9, salt=7)
    out1 = llm.generate([turn1], GREEDY, use_tqdm=False)[0]
    turn2 = [*turn1, *out1.outputs[0].token_ids, *prompt(5, salt=8)]
    out2 = llm.generate([turn2], GREEDY, use_tqdm=False)[0]
    assert out2.outputs[0].token_ids == ck.reference(turn2, NEW)
    assert out2.num_cached_tokens >= 8
