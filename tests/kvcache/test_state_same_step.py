"""The state (Mamba) path of the KV cache manager: waiting for what this step writes.

A prompt whose hit would need a block or snapshot that is still pending (being
written in this step) is told to wait, with no side effects, and hits the
step after; a shorter computed hit is offered with `wait` meanwhile, and a
hit never copies slots written in this step.
"""

from __future__ import annotations

from _cache_seqs import add_seq
from _state_groups import admit, assert_sound, make, pool_state, run, seq


def test_same_step_identical_prompts_wait_one_step_then_hit():
    m = make()
    a = seq("a", list(range(1, 11)))
    admit(m, a)
    b = seq("b", list(range(1, 11)))
    b = add_seq(m, b)
    before = pool_state(m, [a, b])
    hit = m.get_computed_blocks(b.request_id)
    assert hit.wait and hit.num_tokens == 0
    assert pool_state(m, [a, b]) == before  # no side effects, nothing allocated
    assert b.kv_blocks == [[], []]
    m.end_step()
    hit = m.get_computed_blocks(b.request_id)
    assert hit.num_tokens == 8 and not hit.wait
    assert m.allocate_slots(b.request_id, 2, 8, hit)
    m.end_step()
    assert_sound(m, [a, b], {"a": 10, "b": 10})


def test_same_step_prompt_sharing_a_pending_full_block_still_waits_for_its_state():
    m = make()
    a = seq("a", list(range(1, 21)))  # block 0 full (pending), snapshots at 12, 16 pending
    admit(m, a)
    b = seq("b", list(a.token_ids))
    b = add_seq(m, b)
    hit = m.get_computed_blocks(b.request_id)
    assert hit.wait and hit.num_tokens == 0  # attention could share; state must wait
    m.end_step()
    hit = m.get_computed_blocks(b.request_id)
    assert (hit.num_tokens, hit.wait) == (16, False)


def test_a_shorter_computed_hit_is_offered_with_wait_when_a_longer_one_is_pending():
    m = make()
    p = seq("p", list(range(1, 14)))  # 13 tokens: block 0 full, snapshot at 12
    run(m, p)
    m.free(p.request_id)
    a = seq("a", [*range(1, 13), *range(40, 48)])  # 20 tokens: hits 12, snapshot at 16
    assert admit(m, a).num_tokens == 12
    b = seq("b", [*a.token_ids, 99, 98])  # would hit 16 next step
    b = add_seq(m, b)
    before = pool_state(m, [a, b])
    hit = m.get_computed_blocks(b.request_id)
    assert pool_state(m, [a, b]) == before
    assert hit.num_tokens == 12 and hit.wait
    m.end_step()
    hit = m.get_computed_blocks(b.request_id)
    assert (hit.num_tokens, hit.wait) == (16, False)


def test_a_hit_never_copies_slots_written_in_this_step():
    m = make()
    p = seq("p", list(range(1, 14)))  # block 0 (hash blocks 0..2) and a snapshot at 12
    run(m, p)
    m.free(p.request_id)
    a = seq("a", [*range(1, 13), *range(40, 48)])  # hash blocks 3, 4 pending in a's block 1
    admit(m, a)
    b = seq("b", [*range(1, 13), *range(40, 44), 7, 7, 7, 7, 7])
    b = add_seq(m, b)
    attention = m.groups[0]
    entries = attention.find_entries(b, 4)
    assert len(entries) == 4 and not entries[3].computed
    assert attention.usable(entries, 4) == (3, True)  # cut back before the pending one
    hit = m.get_computed_blocks(b.request_id)
    assert hit.num_tokens == 12 and hit.wait
    # Were it allocated now (the scheduler defers it instead): a share, no copy at all.
    assert m.allocate_slots(b.request_id, len(b.token_ids) - 12, 12, hit)
    assert m.take_copies() == []
    assert b.kv_blocks[0][0] is a.kv_blocks[0][0]
    m.end_step()
    assert_sound(m, [a, b], {"a": 20, "b": 21})
