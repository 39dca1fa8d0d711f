"""The state (Mamba) path of the KV cache manager: allocation is all or nothing.

Lookup has no side effects; a failed allocation and the free after it change
nothing. The vLLM #44409 seed scenario: a local hit (shared block, copy source,
snapshot page) first in eviction order in a pool just large enough, plus
external tokens, must take its hit blocks before any new ones; a deliberately
interleaved coordinator (each group takes its hit, then its new blocks, in
turn) shows that the scenario catches the bug.
"""

from __future__ import annotations

import pytest
from _cache_seqs import add_seq
from _state_groups import H, PlanManager, assert_sound, make, plan, pool_state, run, seq

from kvserve.kvcache import KVBlock, KVCacheManager, check_invariants
from kvserve.kvcache.plan import CopyOp
from kvserve.kvcache.state_coordinator import StateCoordinator

# -- all or nothing ----------------------------------------------------------------


def test_lookup_has_no_side_effects():
    m = make()
    a = seq("a", list(range(1, 21)))
    run(m, a)
    m.free(a.request_id)
    b = seq("b", [*range(1, 21), 5, 5])
    b = add_seq(m, b)
    before = pool_state(m, [b])
    for _ in range(2):
        hit = m.get_computed_blocks(b.request_id)
        assert hit.num_tokens == 16
    assert pool_state(m, [b]) == before


def test_a_failed_allocation_and_the_free_after_it_change_nothing():
    m = make(num_blocks=12)
    a = seq("a", list(range(1, 21)))  # block 0 shared + block 1 copied on a hit at 16
    run(m, a)
    m.free(a.request_id)
    hog = seq("hog", [200, 201, 202])  # takes the two uncached free blocks
    run(m, hog)
    b = seq("b", [*range(1, 21), *range(60, 120)])  # 80 tokens: 6 new + 1 state > 9 - 3
    b = add_seq(m, b)
    hit = m.get_computed_blocks(b.request_id)
    assert hit.num_tokens == 16
    before = pool_state(m, [b, hog])
    assert not m.allocate_slots(b.request_id, len(b.token_ids) - 16, 16, hit)
    assert pool_state(m, [b, hog]) == before
    assert m.take_copies() == []
    m.free(b.request_id)  # as a scheduler would after giving up on it
    assert pool_state(m, [b, hog]) == before
    m.end_step()
    assert_sound(m, [hog], {"hog": 3})


# -- the seed scenario: local hit + external tokens, hit blocks first in eviction order --


class _DeferStateHitPool:
    """The pool as an interleaving coordinator would use it: a state group's hit page
    is touched only after the attention group took its new blocks."""

    def __init__(self, pool, deferred: set[int]) -> None:
        self._pool = pool
        self._deferred = deferred
        self.later: list[KVBlock] = []

    def __getattr__(self, name: str):
        return getattr(self._pool, name)

    def touch(self, blocks) -> None:
        blocks = list(blocks)
        self.later.extend(b for b in blocks if id(b) in self._deferred)
        self._pool.touch([b for b in blocks if id(b) not in self._deferred])


class InterleavedCoordinator(StateCoordinator):
    """The vLLM #44409 bug on purpose: each group takes its hit, then its new blocks,
    in turn, so the attention group's new blocks may evict the state group's hit."""

    def allocate(self, seq, num_new_tokens, num_computed_tokens, hit, *args):
        if hit is None or not hit.num_tokens:
            return super().allocate(seq, num_new_tokens, num_computed_tokens, hit, *args)
        pages = {id(hit.sources[g.group_id][0]) for g in self.states}
        real = self.pool
        self.pool = proxy = _DeferStateHitPool(real, pages)
        try:
            ok = super().allocate(seq, num_new_tokens, num_computed_tokens, hit, *args)
        finally:
            self.pool = real
        real.touch(proxy.later)
        return ok


class InterleavedManager(PlanManager):
    @classmethod
    def _coordinator_type(cls, has_state: bool) -> type:
        return InterleavedCoordinator


def seed_scenario(cls: type[KVCacheManager]) -> None:
    """vLLM #44409 for full + state: a local hit (a shared block, a copy source and a
    snapshot page) sits at the head of the free queue of a pool just large enough,
    and the request also loads tokens from an external tier."""
    m = make(num_blocks=10, share=1.0, cls=cls)
    a = seq("a", list(range(1, 21)))  # blocks X0 (hash 0..2), X1 (3, 4); snapshots 12, 16
    run(m, a)
    m.free(a.request_id)  # its running page goes to the front, its cached blocks after
    d = seq("d", list(range(100, 117)))  # takes the uncached blocks, leaves its snapshots
    run(m, d)
    b = seq("b", [*range(1, 17), *range(200, 212)])  # 16 local hits, 4 external, 8 new
    b = add_seq(m, b)
    hit = m.get_computed_blocks(b.request_id)
    assert hit.num_tokens == 16
    shared = hit.blocks[0][0]
    assert shared is not None and hit.blocks[0][1] is None
    copy_source = hit.sources[0][3].block
    snap = hit.sources[1][0]
    hit_ids = {shared.block_id, copy_source.block_id, snap.block_id}
    free = m.pool.free_block_ids()
    assert len(free) == 6 and set(free[:4]) >= hit_ids  # first in eviction order
    assert free[0] == snap.block_id  # the state hit is the very first to go
    # Just large enough: 3 hit blocks + copy target + 1 new attention block + running state.
    assert m.allocate_slots(b.request_id, 8, 16, hit, num_external_tokens=4)
    assert_sound(m, [b, d], {"b": 28, "d": 17}, scheduled=(b,), hits=(hit,))
    assert m.pool.num_free == 0
    assert b.kv_blocks[0][0] is shared
    # The state after the external tokens is not the hit's snapshot: the tier loads it
    # into the running page, which the chunk reads.
    assert plan(b).state_in == plan(b).state_out == b.kv_blocks[1][0].block_id
    assert m.take_copies() == [CopyOp(0, copy_source.block_id, 0, b.kv_blocks[0][1].block_id, 0, H)]
    m.end_step()
    assert_sound(m, [b, d], {"b": 28, "d": 17})
    # Preempt, look up again, allocate again: the same guarantees.
    m.free(b.request_id)
    hit = m.get_computed_blocks(b.request_id)
    assert hit.num_tokens == 16 and not hit.wait
    assert m.allocate_slots(b.request_id, 12, 16, hit)
    assert plan(b).state_in == hit.sources[1][0].block_id
    assert_sound(m, [b, d], {"b": 28, "d": 17}, scheduled=(b,), hits=(hit,))
    m.end_step()
    assert_sound(m, [b, d], {"b": 28, "d": 17})
    m.free(b.request_id)
    m.free(d.request_id)
    assert m.pool.num_used == 0
    check_invariants(m, {})


def test_local_state_hits_are_taken_before_new_and_external_blocks():
    seed_scenario(PlanManager)


def test_interleaved_phases_are_caught():
    """The same scenario fails loudly when each group touches its hit and allocates in turn."""
    with pytest.raises(AssertionError, match=r"block \d+ held by groups \[0, 1\]"):
        seed_scenario(InterleavedManager)
