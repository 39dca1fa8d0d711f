"""Exhaustive block boundaries (design.md invariants 5 and 6).

For every prompt length 1 .. 3*bs+1 and decode length 0 .. 2*bs+1, cold and
again with a prefix hit: after every step a request holds exactly
ceil(computed / bs) blocks, slots exist before the step runs, and the hit is
exactly the full blocks of the prompt, capped so one token is computed.
"""

from __future__ import annotations

import pytest
from _cache_seqs import add_seq
from _kvsim import ceil_div, next_token

from kvserve.kvcache import CacheSequence, KVCacheConfig, KVCacheManager, check_invariants


def expected_hit(prompt_len: int, bs: int) -> tuple[int, int, int]:
    """(hit tokens, skip-write tokens, hit blocks) for a prompt seen before."""
    full = prompt_len // bs
    if full == 0 or prompt_len == 1:  # a one-token prompt has nothing to skip
        return 0, 0, 0
    if full * bs == prompt_len:  # 100 % cached: recompute the last token, skip its write
        return prompt_len - 1, prompt_len, full
    return full * bs, 0, full


def run_once(m, rid, prompt, decode_len, chunk, warm_table=None):
    """Prefill in chunks of `chunk`, then decode `decode_len` tokens; check every step.

    `warm_table`: block ids of an earlier identical run that is still cached; every
    full block of this run must then be that very block (hit or merged).
    """
    bs = m.block_size
    seq = CacheSequence(rid, list(prompt))
    seq = add_seq(m, seq)
    p = len(prompt)
    merges_before = m.stats.merges

    def check(computed):
        check_invariants(m, {rid: computed})
        table = m.block_ids(seq.request_id)[0]
        assert len(table) == ceil_div(computed, bs), (p, decode_len, computed)
        assert m.pool.num_used == len(table)
        if warm_table is not None:
            full = computed // bs
            assert table[:full] == warm_table[:full]

    # Prefill.
    hit = m.get_computed_blocks(seq.request_id, 0)
    want_hit = expected_hit(p, bs) if warm_table is not None else (0, 0, 0)
    assert (hit.num_tokens, hit.skip_write_tokens, len(hit.blocks[0])) == want_hit
    if warm_table is not None:
        assert [b.block_id for b in hit.blocks[0]] == warm_table[: want_hit[2]]
    computed = hit.num_tokens
    first = True
    while computed < p:
        if not first:  # later chunks start after our own blocks: nothing new to find
            later = m.get_computed_blocks(seq.request_id, computed)
            assert later.num_tokens == 0
        n = min(chunk, p - computed)
        assert m.allocate_slots(seq.request_id, n, computed, hit if first else None)
        # Slots for exactly the scheduled tokens exist before the step runs.
        assert len(m.block_ids(seq.request_id)[0]) == ceil_div(computed + n, bs)
        m.end_step()
        computed += n
        first = False
        check(computed)
    assert computed == p
    seq.token_ids.append(next_token(seq.token_ids))
    # Decode: one token per step.
    for _ in range(decode_len):
        assert m.get_computed_blocks(seq.request_id, computed).num_tokens == 0
        assert m.allocate_slots(seq.request_id, 1, computed)
        assert len(m.block_ids(seq.request_id)[0]) == ceil_div(computed + 1, bs)
        m.end_step()
        computed += 1
        check(computed)
        seq.token_ids.append(next_token(seq.token_ids))
    table = m.block_ids(seq.request_id)[0]
    if warm_table is not None:
        # Full blocks that were not hit were written again, found the earlier run's
        # copy and merged into it after their step.
        assert m.stats.merges - merges_before == (p + decode_len) // bs - want_hit[2]
    else:
        assert m.stats.merges == merges_before
    m.free(seq.request_id)
    assert m.pool.num_used == 0
    return table


def prompt_of(p):
    return [(7 * i + 3) % 11 for i in range(p)]


@pytest.mark.parametrize("bs", [1, 4, 16])
def test_blocks_equal_ceil_computed_over_block_size(bs):
    for p in range(1, 3 * bs + 2):
        for d in range(0, 2 * bs + 2):
            blocks = ceil_div(p + d, bs)
            m = KVCacheManager(KVCacheConfig(num_blocks=2 * blocks + 3, block_size=bs))
            cold = run_once(m, "cold", prompt_of(p), d, chunk=p)
            assert len(cold) == blocks
            warm = run_once(m, "warm", prompt_of(p), d, chunk=p, warm_table=cold)
            assert warm[: (p + d) // bs] == cold[: (p + d) // bs]
            check_invariants(m, {})


@pytest.mark.parametrize("bs", [4, 16])
def test_chunked_prefill_boundaries(bs):
    chunks = sorted({1, bs - 1, bs, bs + 1, 2 * bs} - {0})
    for p in range(1, 3 * bs + 2):
        for chunk in chunks:
            for d in (0, 1, bs):
                blocks = ceil_div(p + d, bs)
                m = KVCacheManager(KVCacheConfig(num_blocks=2 * blocks + 3, block_size=bs))
                cold = run_once(m, "cold", prompt_of(p), d, chunk)
                run_once(m, "warm", prompt_of(p), d, chunk, warm_table=cold)


@pytest.mark.parametrize("bs", [1, 4, 16])
def test_fully_cached_prompt_computes_exactly_one_token(bs):
    """nano-vllm #114: a 100 % prefix hit must not become a zero-length prefill."""
    for k in (1, 2, 3):
        p = k * bs
        m = KVCacheManager(KVCacheConfig(num_blocks=k + 1, block_size=bs))  # no spare block
        first = CacheSequence("first", prompt_of(p))
        first = add_seq(m, first)
        assert m.allocate_slots(first.request_id, p, 0)
        m.end_step()
        table = m.block_ids(first.request_id)[0]
        m.free(first.request_id)
        assert m.pool.num_free == k  # every block is free, and still cached

        again = CacheSequence("again", prompt_of(p))
        again = add_seq(m, again)
        hit = m.get_computed_blocks(again.request_id, 0)
        if p == 1:  # bs 1, one token: nothing may be skipped at all
            assert (hit.num_tokens, hit.skip_write_tokens, hit.blocks[0]) == (0, 0, [])
            continue
        assert (hit.num_tokens, hit.skip_write_tokens) == (p - 1, p)
        assert m.allocate_slots(again.request_id, p - hit.num_tokens, hit.num_tokens, hit)
        assert p - hit.num_tokens == 1  # exactly one token is computed
        assert m.block_ids(again.request_id)[0] == table
        assert m.pool.num_free == 0
        m.end_step()
        check_invariants(m, {"again": p})
        # The next token needs a block, and there is none: refused, nothing changed.
        again.token_ids.append(1)
        assert not m.allocate_slots(again.request_id, 1, p)
        assert m.block_ids(again.request_id)[0] == table
        check_invariants(m, {"again": p})
        m.free(again.request_id)
        assert m.pool.num_used == 0
