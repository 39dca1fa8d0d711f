"""The state (Mamba) path of the KV cache manager: snapshots and state plans.

Where the state group snapshots its state (physical-block fills and the
prompt's last hash-block boundary), what each step's state plan reads and
writes through prefill chunks and decode, no second snapshot for a hash
already snapshotted, and the bounded share of the pool snapshots may take
(oldest free snapshot dropped first, the share split between state groups,
snapshots held in the step never dropped for room).
"""

from __future__ import annotations

import pytest
from _cache_seqs import add_seq
from _state_groups import (
    H,
    P,
    admit,
    assert_sound,
    make,
    plan,
    run,
    seq,
    snapshot_offsets,
    state_group,
    state_index,
)

# -- snapshot positions and state plans ---------------------------------------------


def expected_snapshots(length: int, start: int, end: int) -> list[int]:
    fills = {p for p in range(P, end + 1, P) if p > start}
    last = (length - 1) // H * H
    if start < last <= end:
        fills.add(last)
    return sorted(fills)


@pytest.mark.parametrize("length", range(1, 38))
def test_snapshots_at_physical_fills_and_the_prompt_last_hash_boundary(length):
    m = make(num_blocks=64)
    s = seq("s", list(range(1, length + 1)))
    s = add_seq(m, s)
    assert state_group(m).snapshot_positions(s, 0, length) == expected_snapshots(length, 0, length)
    admit(m, s)
    p = plan(s)
    assert p.state_in == 0  # a first chunk starts from zeros
    assert p.state_out == s.kv_blocks[1][0].block_id
    assert snapshot_offsets(s) == expected_snapshots(length, 0, length)
    pages = [page for _, page in p.snapshots]
    assert len(set(pages)) == len(pages) and p.state_out not in pages
    # Each snapshot is indexed under the hash block that ends at its position.
    index = state_index(m)
    for pos, page in p.snapshots:
        assert index[s.block_hashes[pos // H - 1]].block_id == page
    m.end_step()
    assert_sound(m, [s], {"s": length})


def test_chunked_prefill_plans_read_the_running_state_and_snapshot_at_chunk_offsets():
    m = make()
    s = seq("s", list(range(1, 31)))  # 30 tokens: snapshots at 12, 24 and 28
    running = None
    for start, num, snaps in [(0, 8, []), (8, 8, [(12, 4)]), (16, 14, [(24, 8), (28, 12)])]:
        if start == 0:
            admit(m, s, num_new=num)
            running = s.kv_blocks[1][0].block_id
        else:
            assert m.allocate_slots(s.request_id, num, start)
        p = plan(s)
        assert p.state_in == (0 if start == 0 else running)
        assert p.state_out == running
        assert [(start + off, off) for off, _ in p.snapshots] == snaps
        m.end_step()
        assert_sound(m, [s], {"s": start + num})
    assert len(state_index(m)) == 3


def test_decode_snapshots_only_when_it_fills_a_physical_block():
    m = make()
    s = seq("s", list(range(1, 23)))  # 22 tokens: snapshots at 12 and 20
    run(m, s)
    assert len(state_index(m)) == 2
    running = s.kv_blocks[1][0].block_id
    for t in range(22, 27):  # decode positions 22..26
        s.token_ids.append(100 + t)
        assert m.allocate_slots(s.request_id, 1, t)
        p = plan(s)
        assert (p.state_in, p.state_out) == (running, running)
        # Position 23 makes 24 tokens: the second physical block fills.
        assert p.snapshots == ([(1, p.snapshots[0][1])] if t + 1 == 2 * P else [])
        m.end_step()
        assert_sound(m, [s], {"s": t + 1})
    assert len(state_index(m)) == 3


def test_no_second_snapshot_for_a_hash_already_snapshotted():
    m = make()
    a = seq("a", list(range(1, 21)))  # snapshots at 12 and 16
    run(m, a)
    assert len(state_index(m)) == 2
    # The same 20 tokens and more, allocated from scratch (no hit): 12 and 16 are known.
    b = seq("b", [*range(1, 21), *range(50, 60)])  # 30 tokens: 12, 24, 28 (16 is mid-prompt)
    b = add_seq(m, b)
    assert m.allocate_slots(b.request_id, 30, 0)
    assert snapshot_offsets(b) == [24, 28]
    m.end_step()
    assert len(state_index(m)) == 4
    assert_sound(m, [a, b], {"a": 20, "b": 30})


# -- the bounded share of snapshots ----------------------------------------------------


def test_snapshots_never_exceed_their_share_and_the_oldest_free_goes_first():
    m = make(num_blocks=40, share=0.25)
    share = int(40 * 0.25)
    assert state_group(m).max_snapshots == share
    prompts = [[100 * i + t for t in range(1, 6)] for i in range(1, share + 4)]
    pages: list[bytes] = []
    for i, prompt in enumerate(prompts):  # 5 tokens: one snapshot at 4 each
        s = seq(f"r{i}", prompt)
        run(m, s)
        m.free(s.request_id)
        pages.append(s.block_hashes[0])
        index = state_index(m)
        assert len(index) <= share
        assert list(index) == pages[-share:]  # oldest first out
    # A hit makes a snapshot young again: the next one drops the second oldest instead.
    oldest = pages[-share]
    again = seq("again", prompts[-share])
    assert run(m, again).num_tokens == 4
    m.free(again.request_id)
    s = seq("new", [7, 7, 7, 7, 7])
    run(m, s)
    m.free(s.request_id)
    index = state_index(m)
    assert oldest in index and pages[-share + 1] not in index
    assert len(index) == share


def test_state_groups_split_the_share():
    m = make(num_blocks=40, groups=("full", "mamba:3", "mamba:3"), share=0.25)
    per_group = int(40 * 0.25) // 2
    for i in range(8):
        s = seq(f"r{i}", [50 * i + t for t in range(1, 6)])
        run(m, s)
        m.free(s.request_id)
        total = len(m.pool.index[1]) + len(m.pool.index[2])
        assert len(m.pool.index[1]) <= per_group and len(m.pool.index[2]) <= per_group
        assert total <= 40 * 0.25


def test_snapshots_held_in_this_step_are_never_dropped_for_room():
    m = make(num_blocks=40, share=0.05)  # room for 2 snapshots
    s = seq("s", list(range(1, 31)))  # wants 12, 24, 28
    admit(m, s)
    assert len(snapshot_offsets(s)) == 2
    assert all(b.ref_cnt == 1 for b in s.transient)
    m.end_step()
    assert_sound(m, [s], {"s": 30})
