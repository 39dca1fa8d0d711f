"""Eviction (design.md invariant 9): lazy, least recently used first, a request's tail first."""

from __future__ import annotations

from _cache_seqs import add_seq
from _kvsim import Sim

from kvserve.kvcache import CacheSequence, KVCacheConfig, KVCacheManager, check_invariants

BS = 4


def manager(num_blocks):
    return KVCacheManager(KVCacheConfig(num_blocks=num_blocks, block_size=BS))


def make(m, rid, tokens):
    seq = CacheSequence(rid, list(tokens))
    seq = add_seq(m, seq)
    return seq


A_PROMPT = [1] * 4 + [2] * 4 + [3, 3]  # 2 full blocks + a partial tail
B_PROMPT = [5] * 8  # 2 full blocks


def cached_pair(num_blocks=10):
    """A and B computed in one step, then freed (A first)."""
    m = manager(num_blocks)
    sim = Sim(m)
    a, b = make(m, "a", A_PROMPT), make(m, "b", B_PROMPT)
    assert sim.schedule(a) and sim.schedule(b)
    sim.end_step(append=False)
    ta, tb = m.block_ids(a.request_id)[0], m.block_ids(b.request_id)[0]
    sim.free(a)
    sim.free(b)
    return m, sim, a, b, ta, tb


def test_free_queue_order_lru_across_requests_tail_first_within_one():
    m, _, _, _, ta, tb = cached_pair()
    unused = sorted(set(range(1, 10)) - set(ta) - set(tb))
    assert len(unused) == 4
    # a's partial tail holds nothing reusable: front. Then never-used blocks, then cached
    # blocks in release order: a before b (a freed first), each request's tail first.
    assert m.pool.free_block_ids() == [ta[2], *unused, ta[1], ta[0], tb[1], tb[0]]
    check_invariants(m, {})


def test_new_blocks_evict_in_that_order():
    m, sim, a, b, ta, tb = cached_pair()
    index = m.pool.index[0]
    assert set(index) == {*a.block_hashes, *b.block_hashes}
    c = make(m, "c", [9] * 36)  # distinct content, prefilled one block per step
    taken = []
    for step in range(9):
        assert sim.schedule(c, max_new=BS)
        taken.append(m.block_ids(c.request_id)[0][-1])
        sim.end_step(append=False)
        if step < 5:  # a's tail and the 4 never-used blocks: nothing cached is lost
            assert m.pool.num_evictions == 0
        if step == 5:  # a's last full block goes first ...
            assert a.block_hashes[1] not in index and a.block_hashes[0] in index
        if step == 6:  # ... then a's first block, while b (freed later) is untouched
            assert a.block_hashes[0] not in index
            assert b.block_hashes[0] in index and b.block_hashes[1] in index
        if step == 7:
            assert b.block_hashes[1] not in index and b.block_hashes[0] in index
    assert taken[5:] == [ta[1], ta[0], tb[1], tb[0]]
    assert m.pool.num_evictions == 4
    # c's own blocks are cached now (8 of its 9 full blocks are the cache's content).
    assert set(index) == set(c.block_hashes)


def test_a_hit_refreshes_recency():
    m, sim, _, b, ta, tb = cached_pair()
    again = make(m, "again", A_PROMPT)
    assert sim.schedule(again)
    assert sim.hits == [("again", 8)]
    assert m.block_ids(again.request_id)[0][:2] == ta[:2]
    sim.end_step(append=False)
    own_tail = m.block_ids(again.request_id)[0][2]
    sim.free(again)
    # a's blocks were used last: now b's go before them.
    assert m.pool.free_block_ids()[-4:] == [tb[1], tb[0], ta[1], ta[0]]
    assert m.pool.free_block_ids()[0] == own_tail
    c = make(m, "c", [9] * 28)  # 7 blocks: every uncached block, then b's two
    assert sim.schedule(c)
    assert m.block_ids(c.request_id)[0][-2:] == [tb[1], tb[0]]
    assert set(m.pool.index[0]) >= set(make(m, "a2", A_PROMPT).block_hashes)
    assert not set(b.block_hashes) & set(m.pool.index[0])


def test_lazy_eviction_freed_blocks_are_hit_until_reused():
    m, sim, _, _, ta, _ = cached_pair()
    a2 = make(m, "a2", A_PROMPT)
    hit = m.get_computed_blocks(a2.request_id, 0)
    assert (hit.num_tokens, [x.block_id for x in hit.blocks[0]]) == (8, ta[:2])
    # Reuse 6 blocks (5 uncached + a's tail block): a's first block survives.
    c = make(m, "c", [9] * 24)
    assert sim.schedule(c)
    sim.end_step(append=False)
    hit = m.get_computed_blocks(a2.request_id, 0)
    assert (hit.num_tokens, [x.block_id for x in hit.blocks[0]]) == (4, ta[:1])
    d = make(m, "d", [8] * 4)
    assert sim.schedule(d)  # takes a's first block too
    sim.end_step(append=False)
    assert m.get_computed_blocks(a2.request_id, 0).num_tokens == 0
    hit = m.get_computed_blocks(make(m, "b2", B_PROMPT).request_id, 0)  # b was freed last: intact
    assert (hit.num_tokens, hit.skip_write_tokens, len(hit.blocks[0])) == (7, 8, 2)


def test_fully_cached_prompt_from_the_free_queue():
    """A 100 % cached prompt whose blocks are all free: one token computed, no crash."""
    m, sim, _, _, _, tb = cached_pair(num_blocks=6)  # 5 usable: a=3, b=2
    assert m.pool.num_free == 5
    b2 = make(m, "b2", B_PROMPT)
    assert sim.schedule(b2)
    assert sim.hits == [("b2", 7)]
    assert b2.skip_write_tokens == 8
    assert m.block_ids(b2.request_id)[0] == tb
    sim.end_step()  # computes exactly the one remaining token, then samples
    assert sim.computed == {"b2": 8} and len(b2.token_ids) == 9
    assert m.pool.num_free == 3


def test_allocation_counts_hit_blocks_taken_from_the_free_queue_exactly():
    # 3 usable blocks; a's two full blocks are cached and free.
    m = manager(4)
    sim = Sim(m)
    a = make(m, "a", [1] * 8)
    assert sim.schedule(a)
    sim.end_step(append=False)
    sim.free(a)
    assert m.pool.num_free == 3
    # 13 tokens: 2 hit blocks + 2 new > 3 blocks in all: refused, nothing changes.
    too_big = make(m, "too_big", [1] * 8 + [2] * 5)
    assert not sim.schedule(too_big)
    assert m.pool.num_free == 3 and m.get_computed_blocks(too_big.request_id, 0).num_tokens == 8
    # 12 tokens: 2 hit blocks + 1 new = exactly the pool.
    fits = make(m, "fits", [1] * 8 + [2] * 4)
    assert sim.schedule(fits)
    assert sim.hits == [("fits", 8)]
    assert m.pool.num_free == 0
    sim.end_step()


def test_reset_prefix_cache_refused_while_in_use_then_clears_everything():
    m = manager(10)
    sim = Sim(m)
    a, b = make(m, "a", A_PROMPT), make(m, "b", B_PROMPT)
    assert sim.schedule(a) and sim.schedule(b)
    sim.end_step()
    sim.free(b)
    entries = dict(m.pool.index[0])
    assert len(entries) == 4
    assert m.reset_prefix_cache() is False  # a still holds blocks
    assert m.pool.index[0] == entries  # nothing dropped
    assert m.get_computed_blocks(make(m, "b2", B_PROMPT).request_id, 0).num_tokens == 7
    sim.free(a)
    assert m.reset_prefix_cache() is True
    assert m.pool.index[0] == {}
    assert all(blk.block_hash is None for blk in m.pool.blocks)
    assert m.pool.num_free == 9
    for prompt in (A_PROMPT, B_PROMPT):
        assert m.get_computed_blocks(make(m, "x", prompt).request_id, 0).num_tokens == 0
    check_invariants(m, {})
    # The pool is fully usable afterwards.
    c = make(m, "c", [7] * 36)
    assert sim.schedule(c)
    assert m.pool.num_free == 0
    sim.end_step()


def test_a_block_whose_parent_was_evicted_gives_way_to_a_fresh_copy():
    """Its parent registration is gone for good: keeping it would block the prefix."""
    m = manager(6)
    sim = Sim(m)
    a = make(m, "a", [1] * 4 + [2] * 4 + [3])
    assert sim.schedule(a)
    sim.end_step(append=False)
    first, second = a.kv_blocks[0][:2]
    sim.free(a)
    m.pool.touch([second])  # keep the child; evict only the parent
    while first.block_hash is not None:
        m.pool.take(1)
    for block in m.pool.blocks[1:]:  # give back what the eviction took
        if block is not second and block.ref_cnt:
            m.pool.release([block])
    m.pool.release([second])
    assert second.block_hash is not None  # cached, but chained to a registration now gone
    c = make(m, "c", [1] * 4 + [2] * 4 + [4])
    assert sim.schedule(c)
    sim.end_step(append=False)
    sim.free(c)
    check_invariants(m)
    d = make(m, "d", [1] * 4 + [2] * 4 + [5])
    assert m.get_computed_blocks(d.request_id, 0).num_tokens == 8  # c re-cached both blocks
