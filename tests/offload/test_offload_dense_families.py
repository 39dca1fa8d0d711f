"""The CPU tier under Mistral (every layer in one sliding-window group, no full-attention
anchor) and Gemma 2 (alternating groups): what the small pool evicted comes back from the
tier, and the tokens equal transformers'."""

from __future__ import annotations

import pytest

from tests.offload.test_offload_engine import NEW, PROMPTS, make, tokens, two_rounds


@pytest.mark.parametrize(("arch", "pool"), [("mistral", 16), ("gemma2", 40)])
def test_cpu_tier_serves_what_the_pool_evicted(dense_checkpoints, arch, pool):
    ck = dense_checkpoints[arch]
    expected = [ck.reference(p, NEW) for p in PROMPTS]
    llm = make(ck.path, num_kv_blocks=pool, offload="cpu:64MiB")
    first, second = two_rounds(llm)
    assert tokens(first) == expected
    assert tokens(second) == expected
    stats = llm.stats()
    assert stats["external_hit_tokens"] > 0
    assert stats["offload_bytes_loaded"] > 0 and stats["offload_bytes_saved"] > 0
