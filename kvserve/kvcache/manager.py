"""The manager facade the scheduler talks to, and the coordinator of groups.

One pool serves every group. Allocation is atomic and in two phases: first
every group's local prefix hits are taken, then new blocks are handed out, so
one group's allocation can never evict another group's hit (vLLM #44409).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

from kvserve.kvcache.block import KVBlock
from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.groups import GROUP_TYPES, FullAttentionGroup, SlidingWindowGroup
from kvserve.kvcache.hashing import DEFAULT_HASH, DEFAULT_SEED, BlockHasher, extra_key_bytes
from kvserve.kvcache.inflated_group import CopyOp, InflatedAttentionGroup
from kvserve.kvcache.sequence import CacheSequence
from kvserve.kvcache.specs import FullAttentionSpec, KVCacheSpec, MambaStateSpec
from kvserve.kvcache.state_coordinator import StateCoordinator
from kvserve.kvcache.state_group import MambaStateGroup


@dataclass(slots=True)
class KVCacheConfig:
    """What the manager needs to know; the engine and `simulate` fill it."""

    num_blocks: int
    block_size: int = 16
    enable_prefix_caching: bool = True
    hash_fn: str | Callable[[bytes], bytes] = DEFAULT_HASH
    hash_seed: int = DEFAULT_SEED
    verify_hits: bool = True
    """Compare a hit's token ids before using it (a collision becomes a miss)."""
    specs: list[KVCacheSpec] | None = None
    """One spec per group; default: one full-attention group. With state groups,
    attention block sizes are multiples of `block_size` (kvcache.grouping)."""
    state_snapshot_share: float = 0.25
    """Most of the pool that cached state snapshots may take (state groups only)."""


@dataclass(slots=True)
class PrefixHit:
    """Cached blocks a request can start from, per group, and the tokens they save."""

    blocks: list[list[KVBlock]]
    num_tokens: int
    skip_write_tokens: int = 0
    """> 0 when the whole sequence is cached: its last token is recomputed for
    its logits, but its K/V already sits in a shared block and is not written."""
    sources: list[list] | None = None
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


class KVCacheManager:
    """Longest cached prefix, slots for exactly the scheduled tokens, free.

    Every method either fully succeeds or changes nothing. The scheduler owns
    token counts; the manager owns blocks (see CacheSequence).
    """

    def __init__(self, config: KVCacheConfig) -> None:
        specs = config.specs or [FullAttentionSpec(block_size=config.block_size)]
        has_state = any(isinstance(spec, MambaStateSpec) for spec in specs)
        for spec in specs:
            if spec.block_size != config.block_size and not (
                has_state and spec.block_size % config.block_size == 0
            ):
                raise ValueError(
                    f"group block size {spec.block_size} != hash block size {config.block_size}"
                )
        self.config = config
        self.block_size = config.block_size
        """The hash block size: the unit of matching (physical blocks may be larger)."""
        self.enable_caching = config.enable_prefix_caching
        self.hasher = BlockHasher(config.block_size, config.hash_fn, config.hash_seed)
        self.pool = BlockPool(config.num_blocks, num_groups=len(specs))
        self.groups = (
            self._state_groups(specs, config)
            if has_state
            else [
                GROUP_TYPES[type(spec)](i, spec, self.pool, config.verify_hits)
                for i, spec in enumerate(specs)
            ]
        )
        # Sliding-window blocks verify against the first full-attention group.
        anchor = [g for g in self.groups if type(g) is FullAttentionGroup]
        self._anchor = anchor[0] if anchor else None
        self._windowed = [g for g in self.groups if g is not self._anchor]
        self._has_windows = any(isinstance(g, SlidingWindowGroup) for g in self.groups)
        # free() releases the anchor group last, so an anchor is never evicted before
        # the window blocks verified against it (a stale anchor breaks later caching).
        self._release_order = sorted(self.groups, key=lambda g: g is self._anchor)
        # Registration runs the other way: window blocks record the anchor's registration.
        self._register_order = self._release_order[::-1]
        self.stats = KVCacheStats()
        self._merging: list[CacheSequence] = []
        self._empty_hit = PrefixHit([[] for _ in specs], 0)
        self._state = StateCoordinator(self) if has_state else None

    def _state_groups(self, specs: list[KVCacheSpec], config: KVCacheConfig) -> list:
        """Inflated attention and state groups; every state page sits in a bounded share."""
        if not 0 < config.state_snapshot_share <= 1:
            raise ValueError(
                f"state_snapshot_share must be in (0, 1], got {config.state_snapshot_share}"
            )
        num_states = sum(isinstance(spec, MambaStateSpec) for spec in specs)
        share = max(1, int(config.num_blocks * config.state_snapshot_share) // num_states)
        groups: list = []
        for i, spec in enumerate(specs):
            if isinstance(spec, MambaStateSpec):
                groups.append(
                    MambaStateGroup(
                        i, spec, self.pool, config.verify_hits, config.block_size, share
                    )
                )
            elif isinstance(spec, FullAttentionSpec):
                groups.append(
                    InflatedAttentionGroup(
                        i, spec, self.pool, config.verify_hits, config.block_size
                    )
                )
            else:
                raise ValueError(
                    "sliding-window layers together with Mamba state layers are not supported"
                )
        if not any(isinstance(g, InflatedAttentionGroup) for g in groups):
            raise ValueError("Mamba state groups need a full-attention group to anchor prefix hits")
        return groups

    # -- requests ---------------------------------------------------------------

    def add_sequence(self, seq: CacheSequence) -> None:
        """Prepare a new sequence: extra keys, empty block tables, prompt hashes."""
        seq.extra_keys = extra_key_bytes(seq.lora_name, seq.cache_salt)
        seq.kv_blocks = [[] for _ in self.groups]
        seq.num_skipped_blocks = [0] * len(self.groups)
        seq.num_cached_blocks = 0
        if self.enable_caching:
            self._hash(seq)
        # Hashing covers full blocks only: check the rest too, so a bad id fails
        # here and not inside a later allocate_slots (DESIGN invariant 11).
        checked = len(seq.block_hashes) * self.block_size if self.enable_caching else 0
        rest = seq.token_ids[checked:]
        try:
            struct.pack(f"<{len(rest)}I", *rest)
        except struct.error as exc:
            raise ValueError(
                f"request {seq.request_id}: token ids must be integers in [0, 2**32): {exc}"
            ) from None

    def _hash(self, seq: CacheSequence) -> None:
        try:
            self.hasher.extend(seq.block_hashes, seq.token_ids, seq.extra_keys)
        except Exception as exc:  # struct.error for ids outside uint32
            raise ValueError(
                f"request {seq.request_id}: token ids must be integers in [0, 2**32): {exc}"
            ) from None

    def get_computed_blocks(self, seq: CacheSequence, num_computed_tokens: int = 0) -> PrefixHit:
        """Longest cached continuation of what `seq` already holds. No side effects.

        Called at admission (nothing held yet) and again before each further
        prefill chunk that starts on a block boundary (another request may
        have cached the next blocks meanwhile). The hit never covers the last
        token: it is computed for its logits; if every block is cached, its
        write is skipped instead (DESIGN invariant 5).
        """
        if self._state is not None:
            return self._state.lookup(seq, num_computed_tokens)
        num_tokens = len(seq.token_ids)
        bs = self.block_size
        held = len(seq.kv_blocks[0])
        if (
            not self.enable_caching
            or held * bs != num_computed_tokens
            or num_computed_tokens >= num_tokens - 1
        ):
            return self._empty_hit
        if len(seq.block_hashes) * bs + bs <= num_tokens:
            self._hash(seq)
        candidate, blocks = self._fixed_point(seq, held, num_tokens // bs)
        if candidate == held:
            return self._empty_hit
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
        anchors = None
        if self._anchor is not None:
            anchors = self._anchor.find_hit(seq, held, candidate)
            candidate = held + len(anchors)
            if candidate == held or not self._windowed:
                return candidate, [anchors]
        windows: dict[int, list[KVBlock]] = {}
        while True:
            stable = True
            for group in self._windowed:
                k, found = group.find_window_hit(seq, held, candidate, anchors)
                windows[group.group_id] = found
                if k < candidate:
                    candidate = k
                    stable = False
            if stable or candidate == held:
                break
        if candidate == held:
            return held, []
        tables = []
        for group in self.groups:
            if group is self._anchor:
                tables.append(anchors[: candidate - held])  # type: ignore[index]
            else:
                tables.append(windows[group.group_id])
        return candidate, tables

    def allocate_slots(
        self,
        seq: CacheSequence,
        num_new_tokens: int,
        num_computed_tokens: int,
        hit: PrefixHit | None = None,
        num_lookahead_tokens: int = 0,
        num_external_tokens: int = 0,
    ) -> bool:
        """Give `seq` slots for `num_new_tokens` tokens after its computed ones.

        `num_computed_tokens` already includes `hit.num_tokens`;
        `num_external_tokens` follow them (loaded from an external tier, so
        they need new blocks too). All or nothing: returns False and changes
        nothing when the pool is short (sliding-window blocks that no token
        reads any more are released first either way). Full blocks whose
        tokens are all scheduled are registered now, as pending, so a request
        admitted later in this same step shares them.
        """
        if self._state is not None:
            return self._state.allocate(
                seq,
                num_new_tokens,
                num_computed_tokens,
                hit,
                num_lookahead_tokens,
                num_external_tokens,
            )
        end = num_computed_tokens + num_external_tokens + num_new_tokens
        total = end + num_lookahead_tokens
        pool = self.pool
        hit_tokens = hit.num_tokens if hit is not None else 0
        if self._has_windows:
            # Only what no token from the held ones on reads: the hit is not taken yet.
            for group in self.groups:
                group.remove_skipped(seq, num_computed_tokens - hit_tokens)
        if hit is None or not hit.num_tokens:
            # Fast path (decodes, chunks): no hit blocks to take.
            need = 0
            for group in self.groups:
                need += max(0, group.num_new_blocks(seq, total, 0))
            if need:
                if need > pool.num_free:
                    return False
                for group in self.groups:
                    n = group.num_new_blocks(seq, total, 0)
                    if n > 0:
                        seq.kv_blocks[group.group_id].extend(pool.take(n))
                used = pool.num_used
                if used > self.stats.peak_blocks_used:
                    self.stats.peak_blocks_used = used
        else:
            hit_blocks = hit.blocks
            null = pool.null_block
            needs = [
                max(0, group.num_new_blocks(seq, total, len(hit_blocks[group.group_id])))
                for group in self.groups
            ]
            reclaimed = sum(
                1 for blocks in hit_blocks for b in blocks if b.ref_cnt == 0 and b is not null
            )
            superseded = 0
            if self._has_windows:
                # Held window blocks before the hit end's window: released below.
                for group in self.groups:
                    if isinstance(group, SlidingWindowGroup):
                        table = seq.kv_blocks[group.group_id]
                        stop = min(group._first_needed(num_computed_tokens), len(table))
                        skipped = seq.num_skipped_blocks[group.group_id]
                        superseded += sum(
                            1 for b in table[skipped:stop] if b.ref_cnt == 1 and b is not null
                        )
            if sum(needs) > pool.num_free + superseded - reclaimed:
                return False
            if self._has_windows:
                for group in self.groups:
                    group.remove_skipped(seq, num_computed_tokens)
            # Phase 1: take every group's local hits before anything is allocated,
            # so no group's new or external blocks can evict another group's hit.
            for group in self.groups:
                blocks = hit_blocks[group.group_id]
                pool.touch([b for b in blocks if b is not null])
                seq.kv_blocks[group.group_id].extend(blocks)
            seq.num_cached_blocks = len(seq.kv_blocks[0])
            if hit.skip_write_tokens:
                seq.skip_write_tokens = hit.skip_write_tokens
            # Phase 2: new (and external) blocks for every group.
            for group, n in zip(self.groups, needs, strict=True):
                if n:
                    seq.kv_blocks[group.group_id].extend(pool.take(n))
            self.stats.hit_tokens += hit.num_tokens
            used = pool.num_used
            if used > self.stats.peak_blocks_used:
                self.stats.peak_blocks_used = used
        if self.enable_caching and not seq.cache_chain_broken:
            full = end // self.block_size
            start = seq.num_cached_blocks
            if full > start:
                if len(seq.block_hashes) < full:
                    self._hash(seq)
                had_merges = bool(seq.merges)
                anchors = None
                for group in self._register_order:
                    ids = group.cache_full_blocks(seq, start, full, anchors)
                    if group is self._anchor:
                        anchors = ids
                seq.num_cached_blocks = full
                if seq.merges and not had_merges:
                    self._merging.append(seq)
        return True

    def record_query(self, num_tokens: int) -> None:
        """Count prompt tokens offered to the prefix cache (once per admission)."""
        self.stats.query_tokens += num_tokens

    def end_step(self) -> None:
        """After the runner: pending blocks are computed; duplicates merge away."""
        if self._state is not None:
            self._state.end_step()
        release = self.pool.release
        for seq in self._merging:
            for group_id, i, copy in seq.merges:
                table = seq.kv_blocks[group_id]
                own = table[i]
                table[i] = copy
                release((own,))
                self.stats.merges += 1
            seq.merges.clear()
        self._merging.clear()
        self.pool.end_step()

    def free(self, seq: CacheSequence) -> None:
        """Return every block of `seq` (tail first, so the tail is evicted first).

        Only between steps: blocks `seq` registered as pending in the step being
        scheduled may already be shared, and must be filled by that step.
        """
        release = self.pool.release
        null = self.pool.null_block
        if self._state is not None:
            self._state.forget(seq)
        for group in self._release_order:
            table = seq.kv_blocks[group.group_id]
            if self._has_windows:
                release([b for b in reversed(table) if b is not null])
            else:
                release(reversed(table))
            table.clear()
        seq.num_skipped_blocks = [0] * len(self.groups)
        if seq.merges:
            release([copy for _, _, copy in seq.merges])
            seq.merges.clear()
            if seq in self._merging:
                self._merging.remove(seq)
        seq.num_cached_blocks = 0
        seq.cache_chain_broken = False
        seq.skip_write_tokens = 0

    def take_copies(self) -> list[CopyOp]:
        """Copy-on-write operations the runner must do before this step's forward."""
        return self._state.take_copies() if self._state is not None else []

    def block_ids(self, seq: CacheSequence) -> list[list[int]]:
        """Block table per group, for the runner (0: the null block, never read)."""
        return [[b.block_id for b in table] for table in seq.kv_blocks]

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block; refused (False) while any request holds blocks."""
        return self.pool.reset_prefix_cache()

    # -- introspection ----------------------------------------------------------

    def stats_dict(self) -> dict[str, int]:
        """Cache counters under stable names (duplicates: see kvcache.invariants)."""
        return {
            "prefix_query_tokens": self.stats.query_tokens,
            "prefix_hit_tokens": self.stats.hit_tokens,
            "blocks_used": self.pool.num_used,
            "peak_blocks_used": self.stats.peak_blocks_used,
            "evictions": self.pool.num_evictions,
            "merged_blocks": self.stats.merges,
        }

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_usable

    def blocks_for_tokens(self, num_tokens: int, max_chunk_tokens: int | None = None) -> int:
        """Most blocks one request of `num_tokens` tokens holds at once, all groups together.

        A sliding window holds only its window plus the chunk being computed.
        """
        bs = self.block_size
        full = -(-num_tokens // bs)
        total = 0
        for group in self.groups:
            if isinstance(group, MambaStateGroup):
                total += 2  # the running state and the snapshot a hit resumes from
            elif isinstance(group, InflatedAttentionGroup):
                total += -(-num_tokens // group.block_size) + 1  # + a copy source
            elif isinstance(group, SlidingWindowGroup) and max_chunk_tokens is not None:
                span = group.window - 1 + max_chunk_tokens
                total += min(full, -(-span // bs) + 1)
            else:
                total += full
        return total
