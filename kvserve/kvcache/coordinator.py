"""Coordinators: how the groups of one pool answer a lookup and share an allocation.

The manager picks one coordinator when it is built: `AttentionCoordinator`
for full-attention and sliding-window groups, `StateCoordinator`
(state_coordinator.py) when the model has Mamba state groups. Both keep the
same contract: a lookup has no side effects, and an allocation is atomic and
in two phases (every group's local hits are taken before any new block), so
one group's allocation can never evict another group's hit (vLLM #44409).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.kvcache.block import KVBlock
from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.config import KVCacheConfig
from kvserve.kvcache.groups import FullAttentionGroup, SlidingWindowGroup, attention_group
from kvserve.kvcache.hashing import BlockHasher
from kvserve.kvcache.plan import StepPlan
from kvserve.kvcache.sequence import CacheSequence
from kvserve.kvcache.specs import KVCacheSpec


@dataclass(slots=True)
class PrefixHit:
    """Cached blocks a request can start from, per group, and the tokens they save.

    The scheduler reads `num_tokens`, `skip_write_tokens` and `wait`, and
    hands the hit back to `allocate_slots` unchanged.
    """

    blocks: list[list[Any]]
    num_tokens: int
    skip_write_tokens: int = 0
    """> 0 when the whole sequence is cached: its last token is recomputed for
    its logits, but its K/V already sits in a shared block and is not written."""
    sources: list[list[Any]] = field(default_factory=list)
    """State models: per group, the cache entries a hit copies from (attention)
    or the snapshot it resumes from (state)."""
    wait: bool = False
    """Waiting one step gives a longer hit (it would read what this step writes)."""


@dataclass(slots=True)
class KVCacheStats:
    """Counters; `duplicate blocks` are measured by kvserve.kvcache.invariants."""

    query_tokens: int = 0
    hit_tokens: int = 0
    peak_blocks_used: int = 0
    merges: int = 0


_new_plan = tuple.__new__


class Coordinator:
    """What both coordinators share: hashing, late merges, the end of a step, free."""

    def __init__(self, config: KVCacheConfig, pool: BlockPool, groups: list[Any]) -> None:
        self.block_size = config.block_size
        """The hash block size: the unit of matching (physical blocks may be larger)."""
        self.enable_caching = config.enable_prefix_caching
        self.hasher = BlockHasher(config.block_size, config.hash_fn, config.hash_seed)
        self.pool = pool
        self.groups = groups
        self.stats = KVCacheStats()
        self.in_place_decodes = False
        """True when a step's tokens inside blocks the request holds, filling none, need
        nothing from `allocate`: no window slides past a block, no state is snapshotted
        (KVCacheManager.allocate_slots then skips it)."""
        self.empty_hit = PrefixHit([[] for _ in groups], 0)
        self._merging: list[CacheSequence] = []
        self._release_order: list[Any] = list(groups)
        """free() order; the attention coordinator releases its anchor group last."""
        self._tables_have_nulls = False
        """Sliding windows put the null block in tables: free() skips it."""

    def hash(self, seq: CacheSequence) -> None:
        """Extend `seq.block_hashes` (and `seq.packed_tokens`) over its full hash blocks."""
        try:
            self.hasher.extend(seq.block_hashes, seq.token_ids, seq.extra_keys, seq.packed_tokens)
        except Exception as exc:  # struct.error for ids outside uint32
            raise ValueError(
                f"request {seq.request_id}: token ids must be integers in [0, 2**32): {exc}"
            ) from None

    def plan(self, seq: CacheSequence) -> StepPlan:
        """`seq`'s plan for the step being scheduled (plain data, immutable).

        A query: the tables, copies and state plans of its allocation in this
        step, which stay as they are until `end_step`.
        """
        start = seq.step_start
        num_new_tokens = seq.step_tokens
        end = start + num_new_tokens  # the drafts after it are never cacheable
        # tuple.__new__: the fields in order, without NamedTuple's Python-level __new__.
        return _new_plan(
            StepPlan,
            (
                seq.request_id,
                seq.plan_ids or seq.rebuild_block_ids(),
                start,
                num_new_tokens + seq.step_lookahead,
                seq.skip_write_tokens,
                tuple(seq.copies),
                tuple(seq.state_plans) if seq.state_plans else None,
                min(end // self.block_size, len(seq.block_hashes))
                if self.enable_caching and not seq.cache_chain_broken
                else 0,
                seq.step_lookahead,
            ),
        )

    def _note_peak(self) -> None:
        used = self.pool.num_used
        if used > self.stats.peak_blocks_used:
            self.stats.peak_blocks_used = used

    def _queue_merges(self, seq: CacheSequence, had_merges: bool) -> None:
        if seq.merges and not had_merges:
            self._merging.append(seq)

    def end_step(self) -> None:
        """After the runner: pending blocks are computed; duplicates merge away."""
        release = self.pool.release
        for seq in self._merging:
            for group_id, i, copy in seq.merges:
                table = seq.kv_blocks[group_id]
                own = table[i]
                table[i] = copy
                seq.table_changed(group_id)
                release((own,))
                self.stats.merges += 1
            seq.merges.clear()
        self._merging.clear()
        self.pool.end_step()

    def free(self, seq: CacheSequence) -> None:
        """Return every block of `seq`, tail first, so the tail is evicted first."""
        release = self.pool.release
        null = self.pool.null_block
        for group in self._release_order:
            table = seq.kv_blocks[group.group_id]
            if self._tables_have_nulls:
                release([b for b in reversed(table) if b is not null])
            else:
                release(reversed(table))
            table.clear()
            seq.table_changed(group.group_id)
        seq.num_skipped_blocks = [0] * len(self.groups)
        if seq.merges:
            release([copy for _, _, copy in seq.merges])
            seq.merges.clear()
            if seq in self._merging:
                self._merging.remove(seq)
        seq.num_cached_blocks = 0
        seq.slot_end = 0
        seq.cache_chain_broken = False
        seq.skip_write_tokens = 0
        seq.copies.clear()

    def blocks_for_tokens(self, num_tokens: int, max_chunk_tokens: int | None = None) -> int:
        """Most blocks one request of `num_tokens` tokens holds at once, all groups together."""
        return sum(g.max_blocks_held(num_tokens, max_chunk_tokens) for g in self.groups)


class AttentionCoordinator(Coordinator):
    """Full-attention and sliding-window groups, physical block = hash block.

    Sliding-window blocks verify against the first full-attention group (the
    anchor): they are registered after it and released before it.
    """

    def __init__(self, config: KVCacheConfig, pool: BlockPool, specs: list[KVCacheSpec]) -> None:
        for spec in specs:
            if spec.block_size != config.block_size:
                raise ValueError(
                    f"group block size {spec.block_size} != hash block size {config.block_size}"
                )
        groups = [
            attention_group(i, spec, pool, config.verify_hits) for i, spec in enumerate(specs)
        ]
        super().__init__(config, pool, groups)
        anchor = [g for g in groups if type(g) is FullAttentionGroup]
        self._anchor = anchor[0] if anchor else None
        self._windowed = [g for g in groups if g is not self._anchor]
        self._has_windows = any(isinstance(g, SlidingWindowGroup) for g in groups)
        self._tables_have_nulls = self._has_windows
        self.in_place_decodes = not self._has_windows
        # free() releases the anchor group last, so an anchor is never evicted before
        # the window blocks verified against it (a stale anchor breaks later caching).
        self._release_order = sorted(groups, key=lambda g: g is self._anchor)
        # Registration runs the other way: window blocks record the anchor's registration.
        self._register_order = self._release_order[::-1]

    def lookup(self, seq: CacheSequence, num_computed_tokens: int) -> PrefixHit:
        """Longest cached continuation of what `seq` holds (see KVCacheManager)."""
        num_tokens = len(seq.token_ids)
        bs = self.block_size
        held = len(seq.kv_blocks[0])
        if (
            not self.enable_caching
            or held * bs != num_computed_tokens
            or num_computed_tokens >= num_tokens - 1
        ):
            return self.empty_hit
        if len(seq.block_hashes) * bs + bs <= num_tokens:
            self.hash(seq)
        candidate, blocks = self._fixed_point(seq, held, num_tokens // bs)
        if candidate == held:
            return self.empty_hit
        end = candidate * bs
        if end >= num_tokens:
            return PrefixHit(blocks, num_tokens - 1 - num_computed_tokens, skip_write_tokens=end)
        return PrefixHit(blocks, end - num_computed_tokens)

    def _fixed_point(
        self, seq: CacheSequence, held: int, candidate: int
    ) -> tuple[int, list[list[KVBlock]]]:
        """Longest hit every group accepts: each group may only shorten the candidate.

        Full attention accepts any prefix of its run of hits; a sliding window
        accepts only ends whose window is cached, so the groups are asked in
        turn until none shortens the candidate any more.
        """
        anchors: list[KVBlock] = []
        if self._anchor is not None:
            anchors = self._anchor.find_hit(seq, held, candidate)
            candidate = held + len(anchors)
            if candidate == held or not self._windowed:
                return candidate, [anchors]
        windows: dict[int, list[KVBlock]] = {}
        while True:
            stable = True
            for group in self._windowed:
                k, found = group.find_window_hit(
                    seq, held, candidate, anchors if self._anchor is not None else None
                )
                windows[group.group_id] = found
                if k < candidate:
                    candidate = k
                    stable = False
            if stable or candidate == held:
                break
        if candidate == held:
            return held, []
        return candidate, [
            anchors[: candidate - held] if group is self._anchor else windows[group.group_id]
            for group in self.groups
        ]

    def allocate(
        self,
        seq: CacheSequence,
        num_new_tokens: int,
        num_computed_tokens: int,
        hit: PrefixHit | None,
        num_lookahead_tokens: int,
        num_external_tokens: int,
    ) -> bool:
        """Slots for the chunk, all or nothing (see KVCacheManager.allocate_slots)."""
        end = num_computed_tokens + num_external_tokens + num_new_tokens
        total = end + num_lookahead_tokens
        pool = self.pool
        groups = self.groups
        hit_tokens = hit.num_tokens if hit is not None else 0
        if self._has_windows:
            # Only what no token from the held ones on reads: the hit is not taken yet.
            for group in groups:
                group.remove_skipped(seq, num_computed_tokens - hit_tokens)
        if not hit_tokens and not num_external_tokens:
            # Fast path (decodes, chunks): no hit blocks to take. Every group's table has
            # one entry per block of the request (a window's released ones are the null
            # block), so one comparison tells whether any group needs a block.
            need = 0
            if total > len(seq.kv_blocks[0]) * self.block_size:
                for group in groups:
                    need += max(0, group.num_new_blocks(seq, total, 0))
            if need:
                if need > pool.num_free:
                    return False
                for group in groups:
                    n = group.num_new_blocks(seq, total, 0)
                    if n > 0:
                        seq.kv_blocks[group.group_id].extend(pool.take(n))
                seq.plan_ids = ()
                self._note_peak()
        elif not self._take_hit(
            seq, hit or self.empty_hit, total, num_computed_tokens + num_external_tokens
        ):
            return False
        if self.enable_caching and not seq.cache_chain_broken:
            full = end // self.block_size
            start = seq.num_cached_blocks
            if full > start:
                if len(seq.block_hashes) < full:
                    self.hash(seq)
                had_merges = bool(seq.merges)
                anchors = None
                for group in self._register_order:
                    ids = group.cache_full_blocks(seq, start, full, anchors)
                    if group is self._anchor:
                        anchors = ids
                seq.num_cached_blocks = full
                self._queue_merges(seq, had_merges)
        return True

    def _take_hit(self, seq: CacheSequence, hit: PrefixHit, total: int, first: int) -> bool:
        """Phase 1: every group's hit; phase 2: every group's new (and external) blocks.

        `first` is the first position the step computes (after the local hit and
        the external tokens): a sliding window needs no block wholly before the
        window of that token, so those entries are the null block, whether they
        would come from the hit, from the held blocks or from the pool. Without
        this an external hit took blocks for the whole prefix in every sliding
        group: more than the admission check counted, so on a small pool the
        request neither fitted nor was refused.
        """
        pool = self.pool
        null = pool.null_block
        hit_blocks = hit.blocks
        if self._has_windows:
            hit_blocks = self._window_trimmed(seq, hit_blocks, first)
        needs = [
            max(0, group.num_new_blocks(seq, total, len(hit_blocks[group.group_id]), first))
            for group in self.groups
        ]
        reclaimed = sum(
            1 for blocks in hit_blocks for b in blocks if b.ref_cnt == 0 and b is not null
        )
        superseded = 0
        if self._has_windows:
            # Held window blocks before the first computed token's window: released below.
            for group in self.groups:
                if isinstance(group, SlidingWindowGroup):
                    table = seq.kv_blocks[group.group_id]
                    stop = min(group.first_needed(first), len(table))
                    skipped = seq.num_skipped_blocks[group.group_id]
                    superseded += sum(
                        1 for b in table[skipped:stop] if b.ref_cnt == 1 and b is not null
                    )
        if sum(needs) > pool.num_free + superseded - reclaimed:
            return False
        if self._has_windows:
            for group in self.groups:
                group.remove_skipped(seq, first)
        # Phase 1: take every group's local hits before anything is allocated,
        # so no group's new or external blocks can evict another group's hit.
        seq.plan_ids = ()
        for group in self.groups:
            blocks = hit_blocks[group.group_id]
            pool.touch([b for b in blocks if b is not null])
            seq.kv_blocks[group.group_id].extend(blocks)
        seq.num_cached_blocks = len(seq.kv_blocks[0])
        if hit.skip_write_tokens:
            seq.skip_write_tokens = hit.skip_write_tokens
        # Phase 2: new (and external) blocks for every group; a window's entries before
        # `first`'s window are the null block.
        for group, n in zip(self.groups, needs, strict=True):
            group.pad_window(seq, first)
            if n:
                seq.kv_blocks[group.group_id].extend(pool.take(n))
        self.stats.hit_tokens += hit.num_tokens
        self._note_peak()
        return True

    def _window_trimmed(
        self, seq: CacheSequence, hit_blocks: list[list[Any]], first: int
    ) -> list[list[Any]]:
        """The hit with each sliding group's blocks before `first`'s window as the null
        block (an external hit after it moves the window past them): never taken."""
        null = self.pool.null_block
        trimmed = []
        for group, blocks in zip(self.groups, hit_blocks, strict=True):
            if isinstance(group, SlidingWindowGroup):
                cut = group.first_needed(first) - len(seq.kv_blocks[group.group_id])
                if cut > 0 and any(b is not null for b in blocks[:cut]):
                    blocks = [null] * min(cut, len(blocks)) + blocks[cut:]
            trimmed.append(blocks)
        return trimmed
