"""The CPU tier under Mistral (every layer in one sliding-window group, no full-attention
anchor) and Gemma 2 (alternating groups): what the small pool evicted comes back from the
tier, and the tokens equal transformers'."""

from __future__ import annotations

import pytest

from tests.offload.test_offload_engine import assert_cpu_tier_serves_what_the_pool_evicted


@pytest.mark.parametrize(("arch", "pool"), [("mistral", 16), ("gemma2", 40)])
def test_cpu_tier_serves_what_the_pool_evicted(dense_checkpoints, arch, pool):
    assert_cpu_tier_serves_what_the_pool_evicted(dense_checkpoints[arch], pool)
