"""Sharing: identical content is stored once, and only identical content is shared.

design.md invariants 3 and 7: same-step identical prompts share pending blocks
(nano-vllm #219/#243), identical decode blocks merge after the step, freed
index entries are never handed out twice, a hash collision is a miss, and
tenants (cache salt, LoRA) never share.
"""

from __future__ import annotations

import hashlib
import random
import struct

import pytest
from _cache_seqs import add_seq
from _kvsim import Sim, ceil_div, next_token

from kvserve.kvcache import (
    CacheSequence,
    KVCacheConfig,
    KVCacheManager,
    check_invariants,
    count_duplicate_blocks,
)


def manager(num_blocks, bs, **kw):
    return KVCacheManager(KVCacheConfig(num_blocks=num_blocks, block_size=bs, **kw))


def make(m, rid, tokens, lora=None, salt=None):
    seq = CacheSequence(rid, list(tokens), lora_name=lora, cache_salt=salt)
    seq = add_seq(m, seq)
    return seq


PROMPT_600 = [(i * 31 + 7) % 1000 for i in range(600)]


@pytest.mark.parametrize("n", [2, 8])
def test_identical_prompts_in_one_step_share_every_block(n):
    bs = 16
    m = manager(200, bs)
    sim = Sim(m)
    seqs = [make(m, f"r{i}", PROMPT_600) for i in range(n)]
    for seq in seqs:  # all admitted in ONE step
        assert sim.schedule(seq)
    # The first computes everything; the others hit its 37 pending full blocks.
    assert sim.hits == [(f"r{i}", 37 * 16) for i in range(1, n)]
    assert m.stats.hit_tokens == 592 * (n - 1)
    tables = [m.block_ids(s.request_id)[0] for s in seqs]
    assert all(t[:37] == tables[0][:37] for t in tables)
    assert len({t[37] for t in tables}) == n  # one own tail block each
    assert m.pool.num_used == 37 + n
    assert all(not m.pool.blocks[b].computed for b in tables[0][:37])  # shared while pending
    sim.end_step()
    assert all(m.pool.blocks[b].computed for b in tables[0][:37])
    assert count_duplicate_blocks(m, sim.computed) == 0
    assert m.pool.num_used == 37 + n

    # Identical greedy continuations: blocks that fill during decode merge after the step.
    for _ in range(40):
        for seq in seqs:
            assert sim.schedule(seq)
        sim.end_step()
        c = sim.computed["r0"]
        assert all(sim.computed[s.request_id] == c for s in seqs)
        assert count_duplicate_blocks(m, sim.computed) == 0
        assert m.pool.num_used == c // bs + n * (1 if c % bs else 0)
        assert m.stats.merges == (n - 1) * (c // bs - 37)
        tables = [m.block_ids(s.request_id)[0] for s in seqs]
        assert all(t[: c // bs] == tables[0][: c // bs] for t in tables)
    assert sim.computed["r0"] == 640  # 3 blocks filled during decode: 600 -> 640
    assert m.stats.merges == (n - 1) * 3
    for seq in seqs:
        sim.free(seq)
    assert m.pool.num_used == 0


def test_merge_happens_in_the_step_the_block_fills():
    """Mid-step each request writes its own copy; after end_step only one is held."""
    bs = 4
    m = manager(20, bs)
    a, b = make(m, "a", [1, 2, 3, 4, 5, 6]), make(m, "b", [1, 2, 3, 4, 5, 6])
    sim = Sim(m)
    assert sim.schedule(a) and sim.schedule(b)
    sim.end_step()  # prefill 6: block 0 shared, tails own; a, b get token 7 appended
    assert m.pool.num_used == 3
    assert sim.schedule(a) and sim.schedule(b)  # decode position 6: tails not full yet
    sim.end_step()
    assert m.pool.num_used == 3 and m.stats.merges == 0
    assert sim.schedule(a) and sim.schedule(b)  # position 7 fills block 1
    own_b = m.block_ids(b.request_id)[0][1]
    assert m.block_ids(a.request_id)[0][1] != own_b
    assert m.pool.num_used == 3  # b's own copy is still written this step
    sim.end_step()
    assert m.stats.merges == 1
    assert m.block_ids(a.request_id)[0] == m.block_ids(b.request_id)[0]
    assert m.pool.num_used == 2
    assert m.pool.free_block_ids()[0] == own_b  # an uncached block goes to the front


def test_diverging_continuations_do_not_merge():
    bs = 4
    m = manager(20, bs)
    sim = Sim(m)
    a, b = make(m, "a", [1, 2, 3, 4, 5, 6]), make(m, "b", [1, 2, 3, 4, 5, 6])
    assert sim.schedule(a) and sim.schedule(b)
    sim.end_step(append=False)
    a.token_ids.append(0)
    b.token_ids.append(1)
    for _ in range(6):
        assert sim.schedule(a) and sim.schedule(b)
        sim.end_step()
    assert sim.computed == {"a": 12, "b": 12}
    ta, tb = m.block_ids(a.request_id)[0], m.block_ids(b.request_id)[0]
    assert ta[0] == tb[0] and not set(ta[1:]) & set(tb[1:])
    assert m.pool.num_used == 5 and m.stats.merges == 0


@pytest.mark.parametrize("prompt_len", [16, 18])
def test_later_chunk_picks_up_blocks_cached_meanwhile(prompt_len):
    bs = 4
    m = manager(20, bs)
    sim = Sim(m)
    prompt = list(range(10, 10 + prompt_len))
    a, b = make(m, "a", prompt), make(m, "b", prompt)
    assert sim.schedule(a, max_new=4)  # a: one block-aligned chunk
    assert sim.schedule(b)  # b: hits a's pending block 0, computes the rest
    assert sim.hits == [("b", 4)]
    sim.end_step()
    # a's next chunk starts on a block boundary and finds b's blocks 1..3.
    hit = m.get_computed_blocks(a.request_id, 4)
    if prompt_len == 16:
        assert (hit.num_tokens, hit.skip_write_tokens) == (11, 16)
    else:
        assert (hit.num_tokens, hit.skip_write_tokens) == (12, 0)
    assert [x.block_id for x in hit.blocks[0]] == m.block_ids(b.request_id)[0][1:4]
    assert sim.schedule(a)
    sim.end_step()
    assert m.block_ids(a.request_id)[0][:4] == m.block_ids(b.request_id)[0][:4]
    assert m.pool.num_used == ceil_div(prompt_len, bs) + (0 if prompt_len == 16 else 1)


def test_freed_index_entries_are_never_handed_out_twice():
    bs = 4
    m = manager(9, bs)  # 8 usable blocks
    sim = Sim(m)
    olds = [make(m, f"old{i}", [i] * 8) for i in range(4)]
    for seq in olds:
        assert sim.schedule(seq)
    sim.end_step(append=False)
    old_tables = [m.block_ids(s.request_id)[0] for s in olds]
    old_hashes = {h for s in olds for h in s.block_hashes}
    assert len(old_hashes) == 8 and len(m.pool.index[0]) == 8
    for seq in olds:
        sim.free(seq)
    assert m.pool.num_free == 8

    # Each new request takes the least recently freed blocks, tail first.
    news = [make(m, f"new{i}", [10 + i] * 8) for i in range(4)]
    for i, seq in enumerate(news):
        assert sim.schedule(seq)
        assert m.block_ids(seq.request_id)[0] == old_tables[i][::-1]
    ids = [b for s in news for b in m.block_ids(s.request_id)[0]]
    assert sorted(ids) == list(range(1, 9))  # every block exactly once
    assert m.pool.num_evictions == 8
    assert not old_hashes & set(m.pool.index[0])
    assert set(m.pool.index[0]) == {h for s in news for h in s.block_hashes}
    sim.end_step(append=False)
    again = make(m, "again", [0] * 8)
    assert m.get_computed_blocks(again.request_id, 0).num_tokens == 0
    for seq in news:
        sim.free(seq)
    check_invariants(m, {})


def test_hit_blocks_leave_the_free_queue_before_others_allocate():
    bs = 4
    m = manager(7, bs)  # 6 usable
    sim = Sim(m)
    a = make(m, "a", list(range(9)))  # blocks 0, 1 full + a partial tail
    assert sim.schedule(a)
    sim.end_step(append=False)
    sim.free(a)
    h = make(m, "h", list(range(9)))
    assert sim.schedule(h)
    assert sim.hits == [("h", 8)]
    assert m.pool.num_free == 3  # h holds a's 2 blocks and its own tail
    c = make(m, "c", [50] * 12)
    assert sim.schedule(c)  # takes all 3 remaining blocks, none of h's
    assert m.pool.num_free == 0
    assert not set(m.block_ids(h.request_id)[0]) & set(m.block_ids(c.request_id)[0])
    sim.end_step()
    d = make(m, "d", [60])
    assert not sim.schedule(d)  # nothing left: refused, unchanged


# -- collisions: injected weak hashes ---------------------------------------------------


def sum_hash_97(data: bytes) -> bytes:
    """Blocks whose ids are a permutation of each other collide (given the same parent)."""
    return bytes([sum(data) % 97])


def test_collision_is_a_miss_and_breaks_the_chain_below_it():
    bs = 2
    m = manager(20, bs, hash_fn=sum_hash_97)
    sim = Sim(m, strong_hash=False)
    a = make(m, "a", [1, 2, 5, 5, 7])
    b = make(m, "b", [2, 1, 5, 5, 7])  # block 0 is a permutation of a's
    root = sum(b"kvserve-root:0") % 97
    h0 = bytes([(root + 3) % 97])  # ids 1 and 2 packed as uint32 LE sum to 3
    h1 = bytes([(h0[0] + 10) % 97])
    assert a.block_hashes == b.block_hashes == [h0, h1]  # both blocks collide
    assert sim.schedule(a)
    assert sim.schedule(b)  # same step: a's blocks are pending in the index
    assert sim.hits == []  # b's block 0 differs: a miss; its block 1 is never tried
    assert not set(m.block_ids(a.request_id)[0]) & set(m.block_ids(b.request_id)[0])
    assert b.cache_chain_broken  # b's blocks cannot be indexed under a's hashes
    sim.end_step()
    assert sorted(m.pool.index[0]) == sorted([h0, h1])
    assert [m.pool.index[0][h].block_id for h in (h0, h1)] == m.block_ids(a.request_id)[0][:2]
    sim.free(a)
    sim.free(b)
    a2, b2 = make(m, "a2", [1, 2, 5, 5, 7]), make(m, "b2", [2, 1, 5, 5, 7])
    assert m.get_computed_blocks(b2.request_id, 0).num_tokens == 0
    assert sim.schedule(b2) and sim.schedule(a2)
    assert sim.hits == [("a2", 4)]  # a's own chain is still found, b's never
    sim.end_step()


def _fuzz(m, rng, steps=120, vocab=3, max_len=9, sim=None):
    sim = sim or Sim(m, strong_hash=False)
    waiting: list[CacheSequence] = []
    n = 0
    for _ in range(steps):
        for _ in range(rng.randint(0, 2)):
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, max_len))]
            waiting.append(make(m, f"r{n}", prompt, salt=rng.choice([None, None, "s"])))
            n += 1
        order = list(sim.seqs.values()) + waiting
        rng.shuffle(order)
        for seq in order[: rng.randint(0, len(order))]:
            if sim.schedule(seq, rng.choice([None, 1, 2, 3])) and seq in waiting:
                waiting.remove(seq)
        sim.end_step()
        for seq in list(sim.seqs.values()):
            if len(seq.token_ids) > 14 or rng.random() < 0.1:
                sim.free(seq)
    for seq in list(sim.seqs.values()):
        sim.free(seq)
    assert m.pool.num_used == 0
    return sim


@pytest.mark.parametrize(
    "hash_fn",
    [
        lambda data: bytes([sum(data) % 3]),
        lambda data: hashlib.sha256(data).digest()[:1],
    ],
    ids=["sum-mod-3", "sha256-1-byte"],
)
def test_weak_hash_never_gives_a_wrong_hit(hash_fn, monkeypatch):
    broken = []
    from kvserve.kvcache import groups

    original = groups.FullAttentionGroup.cache_full_blocks

    def spy(self, seq, start, end, anchors=None):
        ids = original(self, seq, start, end, anchors)
        broken.append(seq.cache_chain_broken)
        return ids

    monkeypatch.setattr(groups.FullAttentionGroup, "cache_full_blocks", spy)
    total_hits = 0
    for seed in range(6):
        m = manager(12, 2, hash_fn=hash_fn)
        sim = _fuzz(m, random.Random(seed))  # Sim checks every hit's whole prefix
        total_hits += len(sim.hits)
    assert total_hits > 20  # hits did happen ...
    assert any(broken)  # ... and so did collisions


def test_strong_hash_fuzz_keeps_every_invariant():
    for seed in range(4):
        m = manager(12, 2)
        sim = _fuzz(m, random.Random(100 + seed), sim=Sim(m))
        assert sim.hits


# -- tenants -----------------------------------------------------------------------------


def test_salt_and_lora_separate_tenants():
    bs = 4
    m = manager(40, bs)
    sim = Sim(m)
    prompt = list(range(9))
    tenants = [(None, None), (None, "s"), ("x", None), ("x", "s"), (None, "t")]
    firsts = [make(m, f"first{i}", prompt, lora, salt) for i, (lora, salt) in enumerate(tenants)]
    for seq in firsts:
        assert sim.schedule(seq)
    assert sim.hits == []  # same tokens, different tenant: nothing shared
    tables = [set(m.block_ids(s.request_id)[0]) for s in firsts]
    assert sum(map(len, tables)) == len(set().union(*tables)) == 15
    sim.end_step()
    seconds = [make(m, f"second{i}", prompt, lo, sa) for i, (lo, sa) in enumerate(tenants)]
    for seq in seconds:
        assert sim.schedule(seq)
    assert sim.hits == [(f"second{i}", 8) for i in range(len(tenants))]  # own tenant only
    for first, second in zip(firsts, seconds, strict=True):
        assert m.block_ids(second.request_id)[0][:2] == m.block_ids(first.request_id)[0][:2]
    sim.end_step()

    # The salt only enters the first block's hash; later blocks chain from it.
    salted = firsts[1]
    assert (
        salted.block_hashes[1]
        == hashlib.sha256(salted.block_hashes[0] + struct.pack("<4I", *prompt[4:8])).digest()
    )
    block0, block1 = (m.pool.blocks[i] for i in m.block_ids(salted.request_id)[0][:2])
    assert block0.extra == b"S" + struct.pack("<I", 1) + b"s" and block1.extra == b""
    lora = firsts[2]
    lora_bytes = b"L" + struct.pack("<I", 1) + b"x"
    assert (
        lora.block_hashes[1]
        == hashlib.sha256(
            lora.block_hashes[0] + struct.pack("<4I", *prompt[4:8]) + lora_bytes
        ).digest()
    )
    assert next_token(prompt) == next_token(list(prompt))


def test_a_run_is_indexed_up_to_the_first_hash_the_index_holds():
    """register_run's insert is its check: it stops at a hash already indexed, or one the
    run repeats, and indexes nothing from there (the caller verifies that block alone)."""
    from kvserve.kvcache.block_pool import BlockPool

    pool = BlockPool(8)
    blocks = pool.take(6)
    tokens = bytes(range(24))  # 4 bytes a block
    assert pool.register_run(0, blocks[:2], [b"a", b"b"], tokens[:8], b"F", b"x", 0) == 2
    assert [b.cache_id for b in blocks[:2]] == [1, 2]
    assert blocks[0].extra == b"F" and blocks[1].extra == b"x"
    # "b" is indexed (blocks[1]): a run through it indexes the blocks before it only
    assert pool.register_run(0, blocks[2:5], [b"c", b"b", b"d"], tokens[8:20], b"", b"", 2) == 1
    assert pool.index[0] == {b"a": blocks[0], b"b": blocks[1], b"c": blocks[2]}
    assert (blocks[2].parent_cache_id, blocks[2].cache_id) == (2, 3)
    assert blocks[2].token_ids == tokens[8:12]
    assert blocks[3].block_hash is None and blocks[4].block_hash is None
    # a hash the run repeats stops it too (only a collision repeats one)
    assert pool.register_run(0, blocks[3:6], [b"e", b"f", b"e"], tokens[12:24], b"", b"", 0) == 2
    assert pool.index[0][b"e"] is blocks[3] and pool.index[0][b"f"] is blocks[4]
    assert blocks[5].block_hash is None
    assert pool.pending == blocks[:5]  # computed at end_step, the stopped ones never
    assert [b.cache_id for b in blocks[3:5]] == [4, 5]
