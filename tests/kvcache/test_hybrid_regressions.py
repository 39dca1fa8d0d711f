"""Deterministic cases of the bugs test_stateful_hybrid.py found (block size 2)."""

from _cache_seqs import add_seq

from kvserve.kvcache import (
    CacheSequence,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheManager,
    check_invariants,
)
from kvserve.kvcache.specs import SlidingWindowSpec

BS = 2


def manager(num_blocks, *windows):
    specs = [FullAttentionSpec(block_size=BS)] + [
        SlidingWindowSpec(block_size=BS, sliding_window=w) for w in windows
    ]
    return KVCacheManager(KVCacheConfig(num_blocks=num_blocks, block_size=BS, specs=specs))


def prefill(m, seq, num_new=None):
    seq = add_seq(m, seq)
    hit = m.get_computed_blocks(seq.request_id)
    n = len(seq.token_ids) - hit.num_tokens if num_new is None else num_new
    assert m.allocate_slots(seq.request_id, n, hit.num_tokens, hit)
    m.end_step()
    return hit.num_tokens + n


def test_fully_cached_prompt_keeps_the_window_of_its_recomputed_last_token():
    """The last token (position 3) is recomputed with its write skipped: it reads
    keys 3 (window 1: block 1) and 1..3 (window 3: blocks 0 and 1)."""
    m = manager(20, 1, 3)
    a = CacheSequence("a", [0, 1, 2, 0])
    prefill(m, a)
    b = CacheSequence("b", [0, 1, 2, 0])
    b = add_seq(m, b)
    hit = m.get_computed_blocks(b.request_id)
    assert (hit.num_tokens, hit.skip_write_tokens) == (3, 4)
    assert [[blk.block_id != 0 for blk in t] for t in hit.blocks] == [
        [True, True],
        [False, True],
        [True, True],
    ]
    assert m.allocate_slots(b.request_id, 1, 3, hit)
    m.end_step()
    check_invariants(m, {"a": 4, "b": 4})


def test_failed_allocation_keeps_window_blocks_its_next_token_reads():
    """A lookup before a later chunk finds a hit, the allocation fails: the window
    blocks the held tokens still read must stay (only the hit would replace them)."""
    m = manager(16, 3)
    b = CacheSequence("b", [1] * 10 + [2] * 6)
    assert prefill(m, b, 2) == 2  # one block per group
    a = CacheSequence("a", [1] * 10)
    prefill(m, a)  # shares b's first block, four new blocks per group: 5 free
    hit = m.get_computed_blocks(b.request_id, 2)
    assert hit.num_tokens == 8
    window_block = b.kv_blocks[1][0]
    assert not m.allocate_slots(b.request_id, 6, 10, hit)  # 6 blocks needed, 5 free
    assert b.kv_blocks[1] == [window_block] and window_block.ref_cnt == 2
    check_invariants(m, {"a": 10, "b": 2})
    m.free(a.request_id)  # now it fits, from the same (still cached) hit
    hit = m.get_computed_blocks(b.request_id, 2)
    assert hit.num_tokens == 8
    assert m.allocate_slots(b.request_id, 6, 10, hit)
    m.end_step()
    check_invariants(m, {"b": 16})


def test_freeing_keeps_anchors_longer_than_their_window_blocks():
    """A freed request's window blocks are evicted before its full-attention blocks:
    otherwise a window entry outlives its anchor and the next request computing the
    same prefix takes it for a collision, stops caching, and identical requests miss."""
    m = manager(1 + 4 + 2, 3)
    a = CacheSequence("a", [5, 6, 7, 8])
    prefill(m, a)
    m.free(a.request_id)
    c = CacheSequence("c", [9, 9, 9])  # 2 blocks per group: two of a's are evicted
    prefill(m, c)
    m.free(c.request_id)
    b = CacheSequence("b", [5, 6, 7, 8, 9])
    prefill(m, b, 2)  # a first chunk: c's two uncached blocks, nothing evicted
    assert not b.cache_chain_broken
    d = CacheSequence("d", [5, 6, 7, 8, 9, 1])
    d = add_seq(m, d)
    assert m.get_computed_blocks(d.request_id).num_tokens == 2  # b's first block, in both groups
    check_invariants(m, {"b": 2})
