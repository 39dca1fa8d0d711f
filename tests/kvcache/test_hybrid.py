"""Several groups in one pool: sliding windows, the fixed point, two-phase allocation."""

import pytest
from _cache_seqs import add_seq

from kvserve.kvcache import (
    CacheSequence,
    FullAttentionSpec,
    InvariantError,
    KVCacheConfig,
    KVCacheManager,
    check_invariants,
)
from kvserve.kvcache.coordinator import AttentionCoordinator
from kvserve.kvcache.specs import SlidingWindowSpec

BS = 4
WINDOW = 8


def specs(num_windows):
    return [FullAttentionSpec(block_size=BS)] + [
        SlidingWindowSpec(block_size=BS, sliding_window=WINDOW) for _ in range(num_windows)
    ]


def manager(num_blocks, num_windows, cls=KVCacheManager):
    return cls(KVCacheConfig(num_blocks=num_blocks, block_size=BS, specs=specs(num_windows)))


def run_prefill(m, seq):
    seq = add_seq(m, seq)
    hit = m.get_computed_blocks(seq.request_id)
    assert m.allocate_slots(
        seq.request_id, len(seq.token_ids) - hit.num_tokens, hit.num_tokens, hit
    )
    m.end_step()
    return hit


def assert_sound(m, seqs, computed, between_steps=True):
    """No block id in two groups (or twice in one), every held block referenced."""
    check_invariants(m, computed, between_steps=between_steps)
    owner = {}
    for seq in seqs:
        for group, table in enumerate(seq.kv_blocks):
            for block in table:
                if not block.block_id:
                    continue
                assert block.ref_cnt > 0
                assert owner.setdefault(block.block_id, group) == group, (
                    f"block {block.block_id} held by groups {owner[block.block_id]} and {group}"
                )


class InterleavedCoordinator(AttentionCoordinator):
    """The vLLM #44409 bug on purpose: each group touches its hits, then allocates."""

    def allocate(self, seq, num_new, num_computed, hit, lookahead, external):
        if hit is None or not hit.num_tokens:
            return super().allocate(seq, num_new, num_computed, hit, lookahead, external)
        total = num_computed + external + num_new
        null = self.pool.null_block
        for group in self.groups:
            blocks = hit.blocks[group.group_id]
            need = group.num_new_blocks(seq, total, len(blocks))
            self.pool.touch([b for b in blocks if b is not null])
            seq.kv_blocks[group.group_id].extend(blocks)
            seq.kv_blocks[group.group_id].extend(self.pool.take(need))
        seq.num_cached_blocks = len(seq.kv_blocks[0])
        seq.plan_ids = ()  # the tables changed
        return True


class InterleavedManager(KVCacheManager):
    @classmethod
    def _coordinator_type(cls, has_state: bool) -> type:
        return InterleavedCoordinator


@pytest.mark.parametrize("num_windows", [1, 2])
def test_local_hits_are_taken_before_new_and_external_blocks(num_windows):
    groups = 1 + num_windows
    # A: 16 tokens (4 blocks per group) cached and freed first: the oldest, at the head
    # of the free queue. D: 12 unrelated tokens (3 blocks per group), freed after.
    m = manager(1 + groups * 4 + groups * 3, num_windows)
    a = CacheSequence("a", list(range(1, 17)))
    d = CacheSequence("d", list(range(100, 112)))
    run_prefill(m, a)
    run_prefill(m, d)
    m.free(a.request_id)
    m.free(d.request_id)
    assert m.pool.num_free == m.pool.num_usable
    head = m.pool.free_block_ids()[: groups * 4]  # A's blocks: least recently used
    # B: A's first 12 tokens (hit), 4 tokens from an external tier, 8 new tokens.
    b = CacheSequence("b", [*range(1, 13), *range(50, 62)])
    b = add_seq(m, b)
    hit = m.get_computed_blocks(b.request_id)
    assert hit.num_tokens == 12
    full_hit = hit.blocks[0]
    assert len(full_hit) == 3
    for window_hit in hit.blocks[1:]:
        # Position 12 reads keys 5..11: blocks 1 and 2; block 0 is not needed.
        assert window_hit[0].block_id == 0 and len(window_hit) == 3
    hit_ids = {blk.block_id for t in hit.blocks for blk in t if blk.block_id}
    assert set(head) >= hit_ids  # the hits really sit where a wrong order would evict them
    assert m.allocate_slots(b.request_id, 8, 12, hit, num_external_tokens=4)
    assert {blk.block_id for t in b.kv_blocks for blk in t if blk.block_id} >= hit_ids
    assert_sound(m, [b], {"b": 24}, between_steps=False)
    m.end_step()
    assert_sound(m, [b], {"b": 24})
    # Preempt and re-admit: the full lookup again, same soundness.
    m.free(b.request_id)
    hit = m.get_computed_blocks(b.request_id)
    assert hit.num_tokens == 23  # now everything but the last token is cached
    assert m.allocate_slots(b.request_id, 1, 23, hit)
    m.end_step()
    assert_sound(m, [b], {"b": 24})
    m.free(b.request_id)
    assert m.pool.num_used == 0


@pytest.mark.parametrize("num_windows", [1, 2])
def test_interleaved_phases_are_caught(num_windows):
    """The scenario above fails loudly if allocation is interleaved per group."""
    groups = 1 + num_windows
    m = manager(1 + groups * 4 + groups * 3, num_windows, cls=InterleavedManager)
    a = CacheSequence("a", list(range(1, 17)))
    d = CacheSequence("d", list(range(100, 112)))
    run_prefill(m, a)
    run_prefill(m, d)
    m.free(a.request_id)
    m.free(d.request_id)
    b = CacheSequence("b", [*range(1, 13), *range(50, 62)])
    b = add_seq(m, b)
    hit = m.get_computed_blocks(b.request_id)
    m.allocate_slots(b.request_id, 8, 12, hit, 0, 4)
    with pytest.raises((AssertionError, InvariantError)):
        assert_sound(m, [b], {"b": 24}, between_steps=False)


def test_window_blocks_are_released_during_the_run_and_stay_findable():
    m = manager(40, 1)
    seq = CacheSequence("s", list(range(1, 30)))  # 29 tokens
    run_prefill(m, seq)  # all 8 blocks of both groups held while the prompt runs
    assert [len(t) for t in seq.kv_blocks] == [8, 8]
    seq.token_ids.append(500)
    assert m.allocate_slots(seq.request_id, 1, 29)
    m.end_step()
    # Token 29 reads keys 22..29: window blocks 0..4 are released (null), 5..7 kept.
    assert [b.block_id == 0 for b in seq.kv_blocks[1]] == [True] * 5 + [False] * 3
    assert all(b.block_id for b in seq.kv_blocks[0])
    assert_sound(m, [seq], {"s": 30})
    released_ids = [b.block_id for b in m.pool.blocks if b.ref_cnt == 0 and b.block_hash]
    assert len(released_ids) == 5
    # A new request with the same first 20 tokens hits: full attention holds all five
    # blocks, the window needs blocks 3 and 4 (keys 13..19), still cached though released.
    other = CacheSequence("o", [*range(1, 21), 999, 998])
    other = add_seq(m, other)
    hit = m.get_computed_blocks(other.request_id)
    assert hit.num_tokens == 20
    assert [b.block_id == 0 for b in hit.blocks[1]] == [True, True, True, False, False]


def test_window_hit_needs_only_the_window():
    m = manager(60, 1)
    a = CacheSequence("a", list(range(1, 33)))  # 8 blocks
    run_prefill(m, a)
    m.free(a.request_id)
    # Evict the window group's first six blocks (as reuse would): a hit at 32 still
    # works, it reads keys 25..31 only (blocks 6 and 7).
    for i in range(6):
        m.pool._uncache(m.pool.index[1][a.block_hashes[i]])
    b = CacheSequence("b", [*range(1, 33), 7])
    b = add_seq(m, b)
    hit = m.get_computed_blocks(b.request_id)
    assert hit.num_tokens == 32
    assert [blk.block_id == 0 for blk in hit.blocks[1]] == [True] * 6 + [False] * 2
    assert len(hit.blocks[0]) == 8


def test_fixed_point_shortens_to_what_every_group_holds():
    m = manager(60, 1)
    a = CacheSequence("a", list(range(1, 33)))  # 8 blocks per group
    run_prefill(m, a)
    m.free(a.request_id)
    # Evict the window group's block 6 only: ends 7 and 8 lose their window,
    # so the hit falls back to 6 blocks (keys 17..23 sit in blocks 4 and 5).
    blk = m.pool.index[1][a.block_hashes[6]]
    m.pool._uncache(blk)
    b = CacheSequence("b", [*range(1, 33), 7])
    b = add_seq(m, b)
    hit = m.get_computed_blocks(b.request_id)
    assert hit.num_tokens == 24
    assert len(hit.blocks[0]) == 6
    assert [blk.block_id == 0 for blk in hit.blocks[1]] == [True] * 4 + [False] * 2
    assert m.allocate_slots(b.request_id, 9, 24, hit)
    m.end_step()
    assert_sound(m, [b], {"b": 33})
