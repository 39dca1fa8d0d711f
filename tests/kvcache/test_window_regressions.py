"""Sliding windows under external hits and without an anchor: the differential fuzzer's
findings (tests/fuzz), shrunk to the manager calls that showed them."""

from _cache_seqs import add_seq

from kvserve.kvcache import CacheSequence, KVCacheConfig, KVCacheManager, check_invariants
from kvserve.kvcache.specs import FullAttentionSpec, SlidingWindowSpec


def manager(num_blocks, bs, windows, full=True):
    specs = [FullAttentionSpec(block_size=bs)] if full else []
    specs += [SlidingWindowSpec(block_size=bs, sliding_window=w) for w in windows]
    return KVCacheManager(KVCacheConfig(num_blocks=num_blocks, block_size=bs, specs=specs))


def test_an_external_hit_takes_only_the_window_in_a_sliding_group():
    """36 tokens from a tier, then a chunk of 4 (blocks of 4, window 7): full attention
    needs 10 blocks, each window 3 (the first computed token reads keys 30..36), 19 in
    all, within what admission promised (blocks_for_tokens). Taking a block for every
    external token in every window (40) left the request waiting for ever on an idle pool."""
    m = manager(1 + 24, 4, [7] * 3)
    seq = add_seq(m, CacheSequence("a", list(range(3, 43))))
    assert m.blocks_for_tokens(40 + 3, 4) <= m.num_usable_blocks
    assert m.allocate_slots("a", 4, 0, m.get_computed_blocks("a"), num_external_tokens=36)
    tables = m.block_ids("a")
    assert [len(t) for t in tables] == [10] * 4
    assert all(b for b in tables[0])
    for window in tables[1:]:  # blocks 0..6 before the window: the null block
        assert window[:7] == [0] * 7 and all(window[7:])
    assert m.pool.num_used == 10 + 3 * 3
    m.end_step()
    check_invariants(m, {"a": 40})
    # The windows' null entries are never registered (they hold nothing), the rest is.
    assert all(b.block_hash is None for b in seq.kv_blocks[1][:7])
    m.remove_request("a")
    check_invariants(m, {})


def test_an_external_hit_after_a_local_one_leaves_the_local_window_blocks_behind():
    """The local hit's window blocks end before the external tokens' window: they are
    not taken (the null block stands for them), and the pool loses nothing."""
    m = manager(1 + 40, 4, [7])
    a = add_seq(m, CacheSequence("a", list(range(3, 19))))
    assert m.allocate_slots("a", 16, 0, m.get_computed_blocks("a"))
    m.end_step()
    m.remove_request("a")
    add_seq(m, CacheSequence("b", list(range(3, 19)) + list(range(50, 70))))
    hit = m.get_computed_blocks("b")
    assert hit.num_tokens == 16
    assert m.allocate_slots("b", 4, 16, hit, num_external_tokens=12)
    window = m.block_ids("b")[1]
    assert window[:5] == [0] * 5 and all(window[5:])  # position 28 reads keys 22..28
    m.end_step()
    check_invariants(m, {"b": 32})
    assert a.kv_blocks == [[], []]


def test_windows_alone_share_a_block_whose_neighbour_left_the_window():
    """Mistral's shape (every layer slides, window 5 over blocks of 8). Two identical
    sequences register the same block: one while the block before it is still held
    (chained to it), one after it left the window (chained to nothing). Their hits
    never check a parent, so neither may their registration: the second must merge
    into the first, not hold the same content twice (and stop caching)."""
    m = manager(1 + 12, 8, [5], full=False)
    tokens = list(range(3, 27))
    add_seq(m, CacheSequence("a", list(tokens)))
    assert m.allocate_slots("a", 24, 0, m.get_computed_blocks("a"))  # blocks 0-2 at once
    b = add_seq(m, CacheSequence("b", tokens[:16]))
    assert m.allocate_slots("b", 16, 0, m.get_computed_blocks("b"))  # a's pending blocks
    m.end_step()
    for t in tokens[16:]:  # b decodes block 2 token by token: block 1 leaves its window
        b.token_ids.append(t)
        n = len(b.token_ids) - 1
        assert m.allocate_slots("b", 1, n)
        m.end_step()
        check_invariants(m, {"a": 24, "b": n + 1})
    assert not b.cache_chain_broken
    assert m.block_ids("b")[0][2] == m.block_ids("a")[0][2]
