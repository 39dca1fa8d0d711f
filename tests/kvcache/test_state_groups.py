"""The state (Mamba) path of the KV cache manager, step by step.

Specs `full` + `mamba:3` with hash block size 4: attention blocks are inflated
to 12 tokens (k = 3 hash blocks per physical block), the state group snapshots
its state at physical-block fills and at each prompt's last hash-block
boundary, and a hit resumes from such a snapshot (attention: shared whole
blocks, copy-on-write for a hit that ends inside a block).
"""

from __future__ import annotations

import pytest
from _cache_seqs import add_seq

from kvserve.kvcache import (
    CacheSequence,
    FullAttentionSpec,
    KVBlock,
    KVCacheConfig,
    KVCacheManager,
    PrefixHit,
    check_invariants,
)
from kvserve.kvcache.inflated_group import InflatedAttentionGroup
from kvserve.kvcache.plan import CopyOp
from kvserve.kvcache.specs import (
    MambaStateSpec,
    SlidingWindowSpec,
    inflate_for_state,
    spec_from_name,
)
from kvserve.kvcache.state_coordinator import StateCoordinator
from kvserve.kvcache.state_group import MambaStateGroup

H = 4  # hash block size
K = 3  # hash blocks per physical block ('mamba:3')
P = H * K  # physical block: 12 tokens


class PlanManager(KVCacheManager):
    """The real manager; it also keeps the copies its step plans hand out, per step."""

    def __init__(self, config: KVCacheConfig) -> None:
        super().__init__(config)
        self.copies: list[CopyOp] = []

    def allocate_slots(self, *args, **kwargs):
        plan = super().allocate_slots(*args, **kwargs)
        if plan is not None:
            self.copies.extend(plan.copies)
        return plan

    def take_copies(self) -> list[CopyOp]:
        """This step's copy-on-write operations so far (each handed out once)."""
        copies, self.copies = self.copies, []
        return copies

    def end_step(self) -> None:
        super().end_step()
        self.copies = []


def make(
    num_blocks: int = 32,
    groups: tuple[str, ...] = ("full", "mamba:3"),
    share: float = 0.25,
    cls: type[KVCacheManager] = PlanManager,
) -> PlanManager:
    specs = inflate_for_state([spec_from_name(g, H) for g in groups])
    return cls(
        KVCacheConfig(num_blocks=num_blocks, block_size=H, specs=specs, state_snapshot_share=share)
    )


def seq(rid: str, tokens: list[int]) -> CacheSequence:
    return CacheSequence(rid, list(tokens))


def admit(
    m: KVCacheManager, s: CacheSequence, num_new: int | None = None, external: int = 0
) -> PrefixHit:
    """Look `s` up and allocate its first chunk (all the rest by default); must succeed."""
    if not s.kv_blocks:
        s = add_seq(m, s)
    hit = m.get_computed_blocks(s.request_id)
    assert not hit.wait
    if num_new is None:
        num_new = len(s.token_ids) - hit.num_tokens - external
    assert m.allocate_slots(
        s.request_id, num_new, hit.num_tokens, hit, num_external_tokens=external
    )
    return hit


def run(m: KVCacheManager, s: CacheSequence) -> PrefixHit:
    """Admit `s` with its whole prompt and run the step."""
    hit = admit(m, s)
    m.end_step()
    return hit


def state_group(m: KVCacheManager) -> MambaStateGroup:
    return next(g for g in m.groups if isinstance(g, MambaStateGroup))


def state_index(m: KVCacheManager, gid: int = 1) -> dict[bytes, KVBlock]:
    return m.pool.index[gid]


def plan(s: CacheSequence, gid: int = 1):
    return s.state_plans[gid]


def snapshot_offsets(s: CacheSequence, gid: int = 1) -> list[int]:
    """Offsets into this step's chunk after which the state is snapshotted."""
    return [off for off, _ in plan(s, gid).snapshots]


def pool_state(m: KVCacheManager, seqs: list[CacheSequence]) -> tuple:
    """Everything allocate/free/lookup may change."""
    pool = m.pool
    return (
        [m.block_ids(s.request_id) for s in seqs],
        [(s.num_cached_blocks, len(s.merges), [b.block_id for b in s.transient]) for s in seqs],
        [
            (p.state_in, p.state_out, list(p.snapshots)) if p is not None else None
            for s in seqs
            for p in (s.state_plans or [])
        ],
        pool.free_block_ids(),
        [(b.ref_cnt, b.block_hash, b.computed, len(b.entries or ())) for b in pool.blocks],
        [
            {h: (getattr(e, "block", e).block_id, e.computed) for h, e in ix.items()}
            for ix in pool.index
        ],
        pool.num_evictions,
        len(pool.pending),
        list(getattr(m, "copies", [])),
    )


def held_by_group(
    seqs: list[CacheSequence], scheduled: list[CacheSequence], hits: list[PrefixHit]
) -> dict[int, set[int]]:
    """Block id -> groups using it: tables, this step's hits (copy sources, snapshot
    pages to resume from) and the pages of this step's state plans."""
    owners: dict[int, set[int]] = {}
    for s in seqs:
        for gid, table in enumerate(s.kv_blocks):
            for b in table:
                owners.setdefault(b.block_id, set()).add(gid)
    for hit in hits:
        for gid, sources in enumerate(hit.sources or []):
            for src in sources:
                owners.setdefault(getattr(src, "block", src).block_id, set()).add(gid)
    for s in scheduled:
        for gid, p in enumerate(s.state_plans or []):
            if p is None:
                continue
            for page in (p.state_in, p.state_out, *(pg for _, pg in p.snapshots)):
                if page:
                    owners.setdefault(page, set()).add(gid)
    return owners


def assert_sound(
    m: KVCacheManager,
    seqs: list[CacheSequence],
    computed: dict[str, int],
    scheduled: tuple[CacheSequence, ...] = (),
    hits: tuple[PrefixHit, ...] = (),
) -> None:
    """check_invariants, plus: ref counts equal holders; no block id used by two groups
    (tables, and for the step under way: the `scheduled` requests' state plans and the
    `hits` they allocated with); a hit's snapshot page is still its group's snapshot."""
    between_steps = not scheduled
    check_invariants(m, computed, between_steps=between_steps)
    holders: dict[int, int] = {}
    for s in seqs:
        for table in s.kv_blocks:
            for b in table:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        for b in [*s.transient, *(copy for _, _, copy in s.merges)]:
            holders[b.block_id] = holders.get(b.block_id, 0) + 1
    for bid, n in holders.items():
        assert m.pool.blocks[bid].ref_cnt == n, f"block {bid}: ref {m.pool.blocks[bid].ref_cnt}"
    for bid, groups in held_by_group(seqs, list(scheduled), list(hits)).items():
        assert len(groups) == 1, f"block {bid} held by groups {sorted(groups)}"
    for hit in hits:
        for gid, sources in enumerate(hit.sources or []):
            for src in sources:
                if isinstance(src, KVBlock):  # a snapshot page (attention: CacheEntry)
                    assert src.block_hash is not None and src.group == gid, (
                        f"the snapshot page {src.block_id} a hit resumes from was evicted"
                    )
    for s in scheduled:
        for gid, p in enumerate(s.state_plans or []):
            if p is None or p.state_in in (0, p.state_out):
                continue
            page = m.pool.blocks[p.state_in]
            assert page.group == gid and page.block_hash is not None, (
                f"{s.request_id}: resumes from page {p.state_in}, not a cached snapshot"
            )


# -- inflation ---------------------------------------------------------------------


def test_inflation_keeps_the_hash_block_size_and_multiplies_the_physical_block():
    specs = inflate_for_state([spec_from_name(g, H) for g in ("full", "mamba:3")])
    assert [s.block_size for s in specs] == [P, P]
    assert specs[0].page_bytes == specs[1].page_bytes  # one pool, one page size
    m = make()
    assert m.block_size == H
    attention = m.groups[0]
    assert isinstance(attention, InflatedAttentionGroup)
    assert (attention.hash_block_size, attention.block_size, attention.k) == (H, P, K)
    assert state_group(m).hash_block_size == H
    # The hasher still hashes per hash block.
    s = seq("s", list(range(1, 26)))
    s = add_seq(m, s)
    assert len(s.block_hashes) == 25 // H


@pytest.mark.parametrize("k", [1, 2, 5])
def test_inflation_factor_is_the_state_page_in_hash_blocks(k):
    specs = inflate_for_state([spec_from_name("full", H), spec_from_name(f"mamba:{k}", H)])
    assert [s.block_size for s in specs] == [k * H, k * H]


def test_inflation_rounds_up_to_hold_the_state_page():
    full = FullAttentionSpec(block_size=H, dtype_bytes=1)  # 8 bytes per hash block
    specs = inflate_for_state([full, MambaStateSpec(block_size=H, state_bytes=17)])
    assert specs[0].block_size == 3 * H  # 24 bytes >= 17
    assert specs[0].page_bytes >= specs[1].page_bytes


def test_inflation_leaves_models_without_state_alone():
    specs = [spec_from_name("full", H), spec_from_name("sliding:8", H)]
    assert inflate_for_state(specs) == specs


def test_inflation_refuses_sliding_windows_beside_state():
    with pytest.raises(ValueError, match="sliding"):
        inflate_for_state([spec_from_name(g, H) for g in ("full", "sliding:8", "mamba:2")])


def test_inflation_refuses_state_without_attention():
    with pytest.raises(ValueError, match="full-attention"):
        inflate_for_state([spec_from_name("mamba:2", H)])


def test_inflation_refuses_mixed_hash_block_sizes():
    with pytest.raises(ValueError, match="same"):
        inflate_for_state([spec_from_name("full", H), spec_from_name("mamba:2", 2 * H)])


@pytest.mark.parametrize("name", ["mamba", "mamba:0", "mamba:x", "mamba:-1"])
def test_bad_mamba_spec_names_are_errors(name):
    with pytest.raises(ValueError, match="mamba"):
        spec_from_name(name, H)


def test_manager_refuses_sliding_windows_beside_state_and_a_bad_share():
    specs = [
        FullAttentionSpec(block_size=P),
        SlidingWindowSpec(block_size=P, sliding_window=8),
        MambaStateSpec(block_size=P),
    ]
    with pytest.raises(ValueError, match="sliding"):
        KVCacheManager(KVCacheConfig(num_blocks=8, block_size=H, specs=specs))
    with pytest.raises(ValueError, match="share"):
        make(share=0.0)
    with pytest.raises(ValueError, match="share"):
        make(share=1.5)


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
