"""Full attention whose physical block holds several hash blocks (hybrid models).

Matching stays at hash-block granularity: every hash block has its own index
entry (CacheEntry). A hit is shared a whole physical block at a time where
the cached block holds exactly the hit's hash blocks in order; anything else
(a hit that ends inside a block, or hash blocks spread over several blocks)
is copied into the request's own new block before the step (copy-on-write),
which needs the source to be computed already.
"""

from __future__ import annotations

from typing import cast

from kvserve.kvcache.block import ROOT_CACHE_ID, CacheEntry, KVBlock
from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.plan import CopyOp
from kvserve.kvcache.sequence import CacheSequence
from kvserve.kvcache.specs import FullAttentionSpec


class InflatedAttentionGroup:
    """Full attention with physical blocks of k = block_size / hash_block_size hash blocks."""

    __slots__ = (
        "block_size",
        "group_id",
        "hash_block_size",
        "index",
        "k",
        "pool",
        "spec",
        "verify",
    )

    kind = "full_attention"

    def __init__(
        self,
        group_id: int,
        spec: FullAttentionSpec,
        pool: BlockPool,
        verify: bool,
        hash_block_size: int,
    ) -> None:
        if spec.block_size % hash_block_size:
            raise ValueError(
                f"physical block size {spec.block_size} is not a multiple of the hash block "
                f"size {hash_block_size}"
            )
        self.group_id = group_id
        self.spec = spec
        self.block_size = spec.block_size
        self.hash_block_size = hash_block_size
        self.k = spec.block_size // hash_block_size
        self.pool = pool
        self.index = cast("dict[bytes, CacheEntry]", pool.index[group_id])
        self.verify = verify

    def find_entries(self, seq: CacheSequence, max_hash_blocks: int) -> list[CacheEntry]:
        """Cached hash blocks 0, 1, ... of `seq`, each verified against its parent's entry."""
        hashes = seq.block_hashes
        index_get = self.index.get
        hit: list[CacheEntry] = []
        parent = ROOT_CACHE_ID
        hb = self.hash_block_size
        first_extra, other_extra = seq.extra_keys
        verify = self.verify
        for i in range(max_hash_blocks):
            entry = index_get(hashes[i])
            if entry is None:
                break
            if verify and (
                entry.parent_cache_id != parent
                or entry.token_ids != seq.packed_blocks(i, i + 1, hb)
                or entry.extra != (other_extra if i else first_extra)
            ):
                break
            hit.append(entry)
            parent = entry.cache_id
        return hit

    def _shareable(self, entries: list[CacheEntry], m: int) -> KVBlock | None:
        """The cached block that holds hash blocks m*k .. m*k+k-1 exactly, in order.

        The candidate is the block registered for the last of them: where the
        earlier ones are registered elsewhere (it copied them, or computed them
        again), the pool knows whether it still holds those copies.
        """
        k = self.k
        block = entries[m * k + k - 1].block
        holds = self.pool.holds
        for j in range(k):
            entry = entries[m * k + j]
            if entry.slot != j or not holds(block, entry):
                return None
        return block

    def usable(self, entries: list[CacheEntry], candidate: int) -> tuple[int, bool]:
        """Longest hit <= candidate this group can take now, and whether waiting helps.

        Shared blocks may still be pending (filled in this step: design.md
        invariant 8); copied hash blocks must be computed.
        """
        k = self.k
        candidate = min(candidate, len(entries))
        for m in range(-(-candidate // k)):
            lo = m * k
            hi = min(lo + k, candidate)
            if hi - lo == k and self._shareable(entries, m) is not None:
                continue
            for i in range(lo, hi):
                if not entries[i].computed:
                    return i, True
        return candidate, False

    def hit_blocks(self, entries: list[CacheEntry], hit: int) -> list[KVBlock | None]:
        """Per physical block of a `hit`-hash-block hit: the block to share, or None (copy)."""
        k = self.k
        out: list[KVBlock | None] = []
        for m in range(-(-hit // k)):
            out.append(self._shareable(entries, m) if (m + 1) * k <= hit else None)
        return out

    def copies(self, entries: list[CacheEntry], hit: int, m: int, dst: KVBlock) -> list[CopyOp]:
        """Copy ops filling new block `dst` (physical index m) with the hit's hash blocks."""
        k = self.k
        hb = self.hash_block_size
        ops: list[CopyOp] = []
        for i in range(m * k, min(m * k + k, hit)):
            entry = entries[i]
            j = i - m * k
            self.pool.add_holder(entry, dst)
            last = ops[-1] if ops else None
            if (
                last is not None
                and last.src_block == entry.block.block_id
                and last.src_offset + last.num_tokens == entry.slot * hb
                and last.dst_offset + last.num_tokens == j * hb
            ):
                ops[-1] = CopyOp(
                    self.group_id,
                    last.src_block,
                    last.src_offset,
                    last.dst_block,
                    last.dst_offset,
                    last.num_tokens + hb,
                )
            else:
                ops.append(
                    CopyOp(
                        self.group_id,
                        entry.block.block_id,
                        entry.slot * hb,
                        dst.block_id,
                        j * hb,
                        hb,
                    )
                )
        return ops

    def num_new_blocks(self, seq: CacheSequence, num_tokens: int, num_hit: int) -> int:
        """Physical blocks to take so `num_tokens` tokens have slots (`num_hit` are shared)."""
        return -(-num_tokens // self.block_size) - len(seq.kv_blocks[self.group_id]) - num_hit

    def max_blocks_held(self, num_tokens: int, max_chunk_tokens: int | None) -> int:
        """Its table plus the copy-on-write source of a partial hit."""
        return -(-num_tokens // self.block_size) + 1

    def cache_full_blocks(self, seq: CacheSequence, start: int, end: int) -> None:
        """Register hash blocks `start..end-1` (all of their tokens are scheduled).

        A hash block already indexed elsewhere is not indexed twice (the pool
        records that our block holds a copy of it); when a whole physical
        block turns out to be a copy of a cached one, ours is swapped for it
        after the step (a late merge), so identical full blocks are never held
        twice.
        """
        pool = self.pool
        index = self.index
        held = seq.kv_blocks[self.group_id]
        hashes = seq.block_hashes
        tokens = seq.token_ids
        hb = self.hash_block_size
        k = self.k
        first_extra, other_extra = seq.extra_keys
        events = pool.events
        parent = ROOT_CACHE_ID
        if start:
            # Our hash block start-1 may be indexed in another request's block; when
            # that block is reused the entry moves to our copy (BlockPool.add_holder),
            # so this is only a safety net: never chain to a guess.
            previous = index.get(hashes[start - 1])
            if previous is None:
                seq.cache_chain_broken = True
                return
            parent = previous.cache_id
        for i in range(start, end):
            block_hash = hashes[i]
            block_tokens = seq.packed_blocks(i, i + 1, hb)
            extra = other_extra if i else first_extra
            existing = index.get(block_hash)
            m, j = divmod(i, k)
            if existing is None:
                entry = pool.register_entry(
                    self.group_id, held[m], j, block_hash, block_tokens, extra, parent
                )
                parent = entry.cache_id
                if events is not None:
                    events.stored(self.group_id, seq, i, tokens[i * hb : (i + 1) * hb])
            elif existing.block is held[m] and existing.slot == j:
                parent = existing.cache_id
            elif (
                existing.token_ids == block_tokens
                and existing.parent_cache_id == parent
                and existing.extra == extra
            ) or not self.verify:
                pool.add_holder(existing, held[m])
                parent = existing.cache_id
                if j == k - 1:
                    self._merge_if_copy(seq, m)
            else:
                seq.cache_chain_broken = True
                return

    def _merge_if_copy(self, seq: CacheSequence, m: int) -> None:
        """Physical block m is full: if another block holds exactly its hash blocks, use it."""
        k = self.k
        own = seq.kv_blocks[self.group_id][m]
        index_get = self.index.get
        found = [index_get(seq.block_hashes[m * k + j]) for j in range(k)]
        entries = [e for e in found if e is not None]
        if len(entries) < k:
            return
        # Ours may hold some of them registered: the other block holds them all too.
        block = self._shareable(entries, 0)
        if block is not None and block is not own:
            self.pool.touch((block,))
            seq.merges.append((self.group_id, m, block))

    def entry_at(self, seq: CacheSequence, i: int) -> CacheEntry | None:
        """The index entry standing for hash block `i` of `seq` (verification anchor)."""
        return self.index.get(seq.block_hashes[i])
