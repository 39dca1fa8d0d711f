"""Lookup and allocation for models with state (Mamba) groups.

Attention blocks are inflated (kvcache.specs.inflate_for_state), so hits
are found per hash block and may end inside a physical block (copy-on-write);
state groups accept a hit only where a computed snapshot exists. The hit
length is the fixed point over all groups: each may only shorten it. A hit
is looked up only at admission: a state cannot jump ahead in the middle of a
prefill, and a preempted request is looked up again when re-admitted.
"""

from __future__ import annotations

from kvserve.kvcache.block import CacheEntry, KVBlock
from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.config import KVCacheConfig
from kvserve.kvcache.coordinator import Coordinator, PrefixHit
from kvserve.kvcache.inflated_group import InflatedAttentionGroup
from kvserve.kvcache.plan import StatePlan
from kvserve.kvcache.sequence import CacheSequence
from kvserve.kvcache.specs import FullAttentionSpec, KVCacheSpec, MambaStateSpec
from kvserve.kvcache.state_group import MambaStateGroup


def build_state_groups(
    config: KVCacheConfig, pool: BlockPool, specs: list[KVCacheSpec]
) -> list[InflatedAttentionGroup | MambaStateGroup]:
    """Inflated attention and state groups; every state page sits in a bounded share."""
    if not 0 < config.state_snapshot_share <= 1:
        raise ValueError(
            f"state_snapshot_share must be in (0, 1], got {config.state_snapshot_share}"
        )
    for spec in specs:
        if spec.block_size % config.block_size:
            raise ValueError(
                f"group block size {spec.block_size} != hash block size {config.block_size}"
            )
    num_states = sum(isinstance(spec, MambaStateSpec) for spec in specs)
    share = max(1, int(config.num_blocks * config.state_snapshot_share) // num_states)
    groups: list[InflatedAttentionGroup | MambaStateGroup] = []
    for i, spec in enumerate(specs):
        if isinstance(spec, MambaStateSpec):
            groups.append(
                MambaStateGroup(i, spec, pool, config.verify_hits, config.block_size, share)
            )
        elif isinstance(spec, FullAttentionSpec):
            groups.append(
                InflatedAttentionGroup(i, spec, pool, config.verify_hits, config.block_size)
            )
        else:
            raise ValueError(
                "sliding-window layers together with Mamba state layers are not supported"
            )
    if not any(isinstance(g, InflatedAttentionGroup) for g in groups):
        raise ValueError("Mamba state groups need a full-attention group to anchor prefix hits")
    return groups


class StateCoordinator(Coordinator):
    """The hybrid path: per-hash-block hits, copies, snapshots, two phases."""

    def __init__(self, config: KVCacheConfig, pool: BlockPool, specs: list[KVCacheSpec]) -> None:
        super().__init__(config, pool, build_state_groups(config, pool, specs))
        self.hash_block_size = config.block_size
        self.attention = [g for g in self.groups if isinstance(g, InflatedAttentionGroup)]
        self.states = [g for g in self.groups if isinstance(g, MambaStateGroup)]
        self.anchor = self.attention[0]
        self._transient_seqs: list[CacheSequence] = []

    def lookup(self, seq: CacheSequence, num_computed_tokens: int) -> PrefixHit:
        """Longest usable hit at admission; `wait` when one step's wait would give more."""
        hb = self.hash_block_size
        # The last token is always computed, and a state can only resume before it.
        candidate = (len(seq.token_ids) - 1) // hb
        if num_computed_tokens or not self.enable_caching or candidate <= 0:
            return self.empty_hit
        if len(seq.block_hashes) < candidate:
            self.hash(seq)
        anchors = self.anchor.find_entries(seq, candidate)
        found = {self.anchor.group_id: anchors}
        candidate = len(anchors)
        for group in self.attention[1:]:
            found[group.group_id] = group.find_entries(seq, candidate)
        wait = False
        stable = False
        while candidate and not stable:
            stable = True
            for group in self.groups:
                if isinstance(group, InflatedAttentionGroup):
                    c, w = group.usable(found[group.group_id], candidate)
                else:
                    c, w = group.usable(seq, candidate, anchors)
                wait = wait or w
                if c < candidate:
                    candidate = c
                    stable = False
        if not candidate:
            return PrefixHit([[] for _ in self.groups], 0, wait=wait) if wait else self.empty_hit
        blocks: list[list[KVBlock | None]] = []
        sources: list[list[CacheEntry] | list[KVBlock]] = []
        for group in self.groups:
            if isinstance(group, InflatedAttentionGroup):
                entries = found[group.group_id][:candidate]
                blocks.append(group.hit_blocks(entries, candidate))
                sources.append(entries)
            else:
                blocks.append([])
                sources.append([group.hit_page(seq, candidate)])
        return PrefixHit(blocks, candidate * hb, sources=sources, wait=wait)

    def allocate(
        self,
        seq: CacheSequence,
        num_new_tokens: int,
        num_computed_tokens: int,
        hit: PrefixHit | None,
        num_lookahead_tokens: int,
        num_external_tokens: int,
    ) -> bool:
        """Two phases, all or nothing: take every group's hits, then every new block."""
        pool = self.pool
        hb = self.hash_block_size
        chunk_start = num_computed_tokens + num_external_tokens
        end = chunk_start + num_new_tokens
        total = end + num_lookahead_tokens
        if hit is not None and not hit.num_tokens:
            hit = None
        needs = []
        touched: dict[int, KVBlock] = {}
        for group in self.groups:
            gid = group.group_id
            hit_blocks = hit.blocks[gid] if hit is not None else []
            shared = [b for b in hit_blocks if b is not None]
            needs.append(max(0, group.num_new_blocks(seq, total, len(shared))))
            if hit is None:
                continue
            for b in shared:
                touched[b.block_id] = b
            if isinstance(group, MambaStateGroup):
                page = hit.sources[gid][0]
                touched[page.block_id] = page
            else:
                for m, b in enumerate(hit_blocks):
                    if b is None:
                        for entry in hit.sources[gid][m * group.k : (m + 1) * group.k]:
                            touched[entry.block.block_id] = entry.block
        reclaimed = sum(1 for b in touched.values() if b.ref_cnt == 0)
        if sum(needs) > pool.num_free - reclaimed:
            return False
        # Phase 1: every group's hit (shared blocks, copy sources, the snapshot to
        # resume from) is referenced before any block is taken, so nothing taken
        # below can evict another group's hit (vLLM #44409).
        if hit is not None:
            for group in self.groups:
                shared = [b for b in hit.blocks[group.group_id] if b is not None]
                pool.touch(shared)
            sources = [b for b in touched.values() if not any(b in h for h in hit.blocks)]
            pool.touch(sources)
            seq.transient.extend(sources)
            for group in self.states:
                group.touch_hit(hit.sources[group.group_id][0])
        # Phase 2: copy-on-write targets and new blocks for every group.
        seq.plan_ids = ()
        for group, n in zip(self.groups, needs, strict=True):
            table = seq.kv_blocks[group.group_id]
            if hit is not None and isinstance(group, InflatedAttentionGroup):
                entries = hit.sources[group.group_id]
                c = hit.num_tokens // hb
                for m, b in enumerate(hit.blocks[group.group_id]):
                    if b is None:
                        b = pool.take(1)[0]
                        seq.copies.extend(group.copies(entries, c, m, b))
                        n -= 1
                    table.append(b)
            if n > 0:
                table.extend(pool.take(n))
        if hit is not None:
            seq.num_cached_blocks = hit.num_tokens // hb
            self.stats.hit_tokens += hit.num_tokens
        self._note_peak()
        caching = self.enable_caching and not seq.cache_chain_broken
        if caching:
            full = end // hb
            if len(seq.block_hashes) < full:
                self.hash(seq)
            start = seq.num_cached_blocks
            if full > start:
                had_merges = bool(seq.merges)
                for group in self.attention:
                    group.cache_full_blocks(seq, start, full)
                seq.num_cached_blocks = full
                self._queue_merges(seq, had_merges)
        self._plan_states(
            seq,
            hit,
            chunk_start,
            end,
            caching and not seq.cache_chain_broken,
            num_external_tokens > 0,
        )
        if seq.transient and seq not in self._transient_seqs:
            self._transient_seqs.append(seq)
        return True

    def _plan_states(
        self,
        seq: CacheSequence,
        hit: PrefixHit | None,
        start: int,
        end: int,
        snapshot: bool,
        external: bool,
    ) -> None:
        """Each state group's plan for the runner, taking snapshot pages where due."""
        if not seq.state_plans:
            seq.state_plans = [None] * len(self.groups)
        pool = self.pool
        hb = self.hash_block_size
        reserve = len(self.groups)
        for group in self.states:
            gid = group.group_id
            running = seq.kv_blocks[gid][0]
            if external:
                state_in = running.block_id  # the connector loads the external snapshot here
            elif hit is not None:
                state_in = hit.sources[gid][0].block_id
            else:
                state_in = running.block_id if start else 0
            plan = StatePlan(state_in, running.block_id)
            if snapshot:
                for p in group.snapshot_positions(seq, start, end):
                    anchor = self.anchor.entry_at(seq, p // hb - 1)
                    if anchor is None or not group.may_snapshot(seq, p, anchor):
                        continue
                    if pool.num_free <= reserve or not group.make_room():
                        break
                    page = pool.take(1)[0]
                    seq.transient.append(page)
                    group.register_snapshot(seq, p, page, anchor)
                    plan.snapshots.append((p - start, page.block_id))
            seq.state_plans[gid] = plan

    def end_step(self) -> None:
        """Release what was held for the step only, then merge and mark computed."""
        release = self.pool.release
        for seq in self._transient_seqs:
            release(reversed(seq.transient))
            seq.transient.clear()
            seq.copies.clear()  # a copy always has a step-only source: this seq is here
        self._transient_seqs.clear()
        super().end_step()

    def free(self, seq: CacheSequence) -> None:
        """Release the step-only blocks too, then every table."""
        if seq.transient:
            self.pool.release(reversed(seq.transient))
            seq.transient.clear()
            if seq in self._transient_seqs:
                self._transient_seqs.remove(seq)
        seq.state_plans = []
        super().free(seq)
