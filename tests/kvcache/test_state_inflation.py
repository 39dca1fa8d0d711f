"""The state (Mamba) path of the KV cache manager: inflation of the specs.

Beside a state group, attention blocks are inflated to hold one state page
(k hash blocks per physical block) while hashing stays per hash block; the
spec and manager checks refuse sliding windows beside state, state without
full attention, mixed hash block sizes, bad `mamba:k` names and a bad
snapshot share.
"""

from __future__ import annotations

import pytest
from _cache_seqs import add_seq
from _state_groups import H, K, P, make, seq, state_group

from kvserve.kvcache import FullAttentionSpec, KVCacheConfig, KVCacheManager
from kvserve.kvcache.inflated_group import InflatedAttentionGroup
from kvserve.kvcache.specs import (
    MambaStateSpec,
    SlidingWindowSpec,
    inflate_for_state,
    spec_from_name,
)

# -- inflation ---------------------------------------------------------------------


def test_inflation_keeps_the_hash_block_size_and_multiplies_the_physical_block():
    specs = inflate_for_state([spec_from_name(g, H) for g in ("full", "mamba:3")])
    assert [s.block_size for s in specs] == [P, P]
    assert specs[0].page_bytes == specs[1].page_bytes  # one pool, one page size
    m = make()
    assert m.block_size == H
    attention = m.groups[0]
    assert isinstance(attention, InflatedAttentionGroup)
    assert (attention.hash_block_size, attention.block_size, attention.k) == (H, P, K)
    assert state_group(m).hash_block_size == H
    # The hasher still hashes per hash block.
    s = seq("s", list(range(1, 26)))
    s = add_seq(m, s)
    assert len(s.block_hashes) == 25 // H


@pytest.mark.parametrize("k", [1, 2, 5])
def test_inflation_factor_is_the_state_page_in_hash_blocks(k):
    specs = inflate_for_state([spec_from_name("full", H), spec_from_name(f"mamba:{k}", H)])
    assert [s.block_size for s in specs] == [k * H, k * H]


def test_inflation_rounds_up_to_hold_the_state_page():
    full = FullAttentionSpec(block_size=H, dtype_bytes=1)  # 8 bytes per hash block
    specs = inflate_for_state([full, MambaStateSpec(block_size=H, state_bytes=17)])
    assert specs[0].block_size == 3 * H  # 24 bytes >= 17
    assert specs[0].page_bytes >= specs[1].page_bytes


def test_inflation_leaves_models_without_state_alone():
    specs = [spec_from_name("full", H), spec_from_name("sliding:8", H)]
    assert inflate_for_state(specs) == specs


def test_inflation_refuses_sliding_windows_beside_state():
    with pytest.raises(ValueError, match="sliding"):
        inflate_for_state([spec_from_name(g, H) for g in ("full", "sliding:8", "mamba:2")])


def test_inflation_refuses_state_without_attention():
    with pytest.raises(ValueError, match="full-attention"):
        inflate_for_state([spec_from_name("mamba:2", H)])


def test_inflation_refuses_mixed_hash_block_sizes():
    with pytest.raises(ValueError, match="same"):
        inflate_for_state([spec_from_name("full", H), spec_from_name("mamba:2", 2 * H)])


@pytest.mark.parametrize("name", ["mamba", "mamba:0", "mamba:x", "mamba:-1"])
def test_bad_mamba_spec_names_are_errors(name):
    with pytest.raises(ValueError, match="mamba"):
        spec_from_name(name, H)


def test_manager_refuses_sliding_windows_beside_state_and_a_bad_share():
    specs = [
        FullAttentionSpec(block_size=P),
        SlidingWindowSpec(block_size=P, sliding_window=8),
        MambaStateSpec(block_size=P),
    ]
    with pytest.raises(ValueError, match="sliding"):
        KVCacheManager(KVCacheConfig(num_blocks=8, block_size=H, specs=specs))
    with pytest.raises(ValueError, match="share"):
        make(share=0.0)
    with pytest.raises(ValueError, match="share"):
        make(share=1.5)
