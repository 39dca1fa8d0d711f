"""The state (Mamba) path of the KV cache manager: prefix hits and copy-on-write.

A hit resumes the state from a cached snapshot; attention shares whole
physical blocks and copies a hit that ends inside one (the copy source held
until the step ends, even when its request finished); a decode that fills a
block already cached is merged into the cached block after the step.
"""

from __future__ import annotations

import pytest
from _cache_seqs import add_seq
from _state_groups import H, P, admit, assert_sound, make, plan, run, seq, state_index

from kvserve.kvcache.plan import CopyOp

# -- hits ------------------------------------------------------------------------


@pytest.mark.parametrize("length", [5, 8, 9, 10, 11, 12])
def test_a_repeated_short_prompt_hits_by_copy_and_resumes_from_the_snapshot(length):
    m = make()
    a = seq("a", list(range(1, length + 1)))
    run(m, a)  # a keeps running: its block is held
    last = (length - 1) // H * H
    snap = state_index(m)[a.block_hashes[last // H - 1]]
    b = seq("b", list(a.token_ids))
    hit = admit(m, b)
    assert hit.num_tokens == last and not hit.wait
    assert hit.blocks[0] == [None]  # the hit ends inside a physical block: copied
    src = a.kv_blocks[0][0]
    dst = b.kv_blocks[0][0]
    assert dst is not src and dst.ref_cnt == 1
    assert m.take_copies() == [CopyOp(0, src.block_id, 0, dst.block_id, 0, last)]
    assert m.take_copies() == []  # handed over once
    p = plan(b)
    assert p.state_in == snap.block_id
    assert p.state_out == b.kv_blocks[1][0].block_id != snap.block_id
    assert p.snapshots == []  # the prompt's only snapshot position is the hit itself
    assert snap in b.transient and src in b.transient  # held for this step only
    assert_sound(m, [a, b], {"a": length, "b": length}, scheduled=(b,), hits=(hit,))
    m.end_step()
    assert not b.transient
    assert_sound(m, [a, b], {"a": length, "b": length})


def test_a_copied_hit_from_a_finished_request_keeps_its_source_until_the_step_ends():
    m = make(num_blocks=8)
    a = seq("a", list(range(1, 11)))
    run(m, a)
    m.free(a.request_id)
    b = seq("b", list(range(1, 11)))
    hit = admit(m, b)
    assert hit.num_tokens == 8
    (op,) = m.take_copies()
    src = m.pool.blocks[op.src_block]
    assert src.ref_cnt == 1 and src in b.transient  # not evictable while copied from
    # Everything else allocated in this step leaves the source alone.
    c = seq("c", list(range(100, 100 + P * m.pool.num_free)))
    c = add_seq(m, c)
    assert m.allocate_slots(c.request_id, P * (m.pool.num_free - 1), 0)
    assert m.pool.num_free == 0
    assert src.block_id not in m.block_ids(c.request_id)[0] + m.block_ids(c.request_id)[1]
    m.end_step()
    assert src.ref_cnt == 0
    assert_sound(m, [b, c], {"b": 10, "c": len(c.kv_blocks[0]) * P})


@pytest.mark.parametrize("length", [13, 24, 25, 26])
def test_full_physical_blocks_are_shared_not_copied(length):
    m = make()
    a = seq("a", list(range(1, length + 1)))
    run(m, a)
    b = seq("b", list(a.token_ids))
    hit = admit(m, b)
    last = (length - 1) // H * H
    assert hit.num_tokens == last
    whole = last // P
    assert hit.blocks[0][:whole] == a.kv_blocks[0][:whole]
    assert b.kv_blocks[0][:whole] == a.kv_blocks[0][:whole]
    for blk in a.kv_blocks[0][:whole]:
        assert blk.ref_cnt == 2
    copies = m.take_copies()
    if last % P:
        src = a.kv_blocks[0][whole]
        assert copies == [CopyOp(0, src.block_id, 0, b.kv_blocks[0][whole].block_id, 0, last % P)]
    else:
        assert copies == []
    m.end_step()
    assert_sound(m, [a, b], {"a": length, "b": length})


def test_a_decode_that_fills_a_block_already_cached_is_merged_after_the_step():
    m = make()
    a = seq("a", list(range(1, 11)))  # 10 tokens, then decodes 10 and 11
    run(m, a)
    b = seq("b", list(a.token_ids))  # same prompt, admitted a step later: copy hit
    a.token_ids.append(11)
    assert m.allocate_slots(a.request_id, 1, 10)
    assert admit(m, b).num_tokens == 8
    m.take_copies()
    m.end_step()
    b.token_ids.append(11)
    a.token_ids.append(12)
    assert m.allocate_slots(a.request_id, 1, 11)  # a fills its block 0 (12 tokens)
    assert m.allocate_slots(b.request_id, 1, 10)
    m.end_step()
    b.token_ids.append(12)
    a.token_ids.append(13)
    assert m.allocate_slots(a.request_id, 1, 12)
    assert m.allocate_slots(b.request_id, 1, 11)  # b's own copy fills with the same 12 tokens
    assert b.merges and b.kv_blocks[0][0] is not a.kv_blocks[0][0]
    m.end_step()
    assert b.kv_blocks[0][0] is a.kv_blocks[0][0]  # merged: held once
    assert a.kv_blocks[0][0].ref_cnt == 2
    assert m.stats.merges == 1
    assert_sound(m, [a, b], {"a": 13, "b": 12})
