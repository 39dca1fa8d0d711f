"""Two rounds of the same prompts through LLM.generate, checked against transformers.

Shared by the hybrid model tests: the first round fills the cache, the second
must hit (when caching is on) and give the same tokens either way.
"""

from __future__ import annotations

from kvserve import LLM, SamplingParams

MODES = {
    "cached": {},
    "no-cache": {"enable_prefix_caching": False},
    "chunked": {"max_num_batched_tokens": 7},  # chunked prefill, mixed prefill + decode steps
    "preempt": {"max_num_seqs": 8},  # with a pool the caller makes small enough to preempt
}


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def two_rounds(
    llm: LLM, ck, prompts: list[list[int]], params: SamplingParams, mode: str, expect_hits: bool
) -> dict:
    """Run both rounds; assert tokens, hits, preemptions and a drained pool; return stats."""
    new = params.max_tokens
    expected = [ck.reference(p, new) for p in prompts]
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == expected
    first_hits = llm.stats()["prefix_hit_tokens"]
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == expected
    stats = llm.stats()
    if mode == "preempt":
        assert stats["preemptions"] > 0
    if mode == "no-cache":
        assert stats["prefix_hit_tokens"] == 0
    elif expect_hits:
        assert stats["prefix_hit_tokens"] > first_hits
        assert stats["duplicate_blocks_peak"] == 0
    assert llm.engine.manager.pool.num_used == 0
    return stats
