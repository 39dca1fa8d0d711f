"""Shared helpers for the state (Mamba) path tests of the KV cache manager (test_state_*.py).

Specs `full` + `mamba:3` with hash block size 4: attention blocks are inflated
to 12 tokens (k = 3 hash blocks per physical block), the state group snapshots
its state at physical-block fills and at each prompt's last hash-block
boundary, and a hit resumes from such a snapshot (attention: shared whole
blocks, copy-on-write for a hit that ends inside a block).

`make` builds a `PlanManager` (the real manager, keeping the copy-on-write
operations its step plans hand out); `admit`/`run` look a request up and
allocate it; `pool_state` captures everything allocate/free/lookup may change;
`assert_sound` is check_invariants plus ref counts, one group per block and
live snapshot pages for the hits of the step under way.
"""

from __future__ import annotations

from _cache_seqs import add_seq

from kvserve.kvcache import (
    CacheSequence,
    KVBlock,
    KVCacheConfig,
    KVCacheManager,
    PrefixHit,
    check_invariants,
)
from kvserve.kvcache.plan import CopyOp
from kvserve.kvcache.specs import inflate_for_state, spec_from_name
from kvserve.kvcache.state_group import MambaStateGroup

H = 4  # hash block size
K = 3  # hash blocks per physical block ('mamba:3')
P = H * K  # physical block: 12 tokens


class PlanManager(KVCacheManager):
    """The real manager; it also keeps the copies its step plans hand out, per step."""

    def __init__(self, config: KVCacheConfig) -> None:
        super().__init__(config)
        self.copies: list[CopyOp] = []

    def allocate_slots(self, request_id, *args, **kwargs):
        ok = super().allocate_slots(request_id, *args, **kwargs)
        if ok:
            self.copies.extend(self.step_plan(request_id).copies)
        return ok

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
