"""Per-group managers: how one kind of layer finds hits and needs blocks.

The coordinator (manager.py) asks each group the same questions; a sliding
window or state group answers them differently without touching the pool.
"""

from __future__ import annotations

from kvserve.kvcache.block import ROOT_CACHE_ID, KVBlock
from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.sequence import CacheSequence
from kvserve.kvcache.specs import FullAttentionSpec


class FullAttentionGroup:
    """Full attention: a hit is the longest run of cached blocks from the left."""

    __slots__ = ("block_size", "group_id", "index", "pool", "spec", "verify")

    def __init__(
        self, group_id: int, spec: FullAttentionSpec, pool: BlockPool, verify: bool
    ) -> None:
        self.group_id = group_id
        self.spec = spec
        self.block_size = spec.block_size
        self.pool = pool
        self.index = pool.index[group_id]
        self.verify = verify

    def find_hit(self, seq: CacheSequence, start: int, max_blocks: int) -> list[KVBlock]:
        """Cached blocks `start, start+1, ...` (at most up to `max_blocks`).

        With verification on, a block only counts if it holds exactly this
        request's tokens and extra keys and was chained to the very block hit
        just before it: a hash collision is a miss, never a wrong hit.
        """
        hashes = seq.block_hashes
        index_get = self.index.get
        hit: list[KVBlock] = []
        if not self.verify:
            for i in range(start, max_blocks):
                block = index_get(hashes[i])
                if block is None:
                    break
                hit.append(block)
            return hit
        held = seq.kv_blocks[self.group_id]
        parent = held[start - 1].cache_id if start else ROOT_CACHE_ID
        bs = self.block_size
        tokens = seq.token_ids
        first_extra, other_extra = seq.extra_keys
        for i in range(start, max_blocks):
            block = index_get(hashes[i])
            if (
                block is None
                or block.parent_cache_id != parent
                or block.token_ids != tokens[i * bs : (i + 1) * bs]
                or block.extra != (other_extra if i else first_extra)
            ):
                break
            hit.append(block)
            parent = block.cache_id
        return hit

    def num_new_blocks(self, seq: CacheSequence, num_tokens: int, num_hit: int) -> int:
        """Blocks to take from the pool so `num_tokens` tokens have slots."""
        return -(-num_tokens // self.block_size) - len(seq.kv_blocks[self.group_id]) - num_hit

    def cache_full_blocks(self, seq: CacheSequence, start: int, end: int) -> None:
        """Register blocks `start..end-1` (all of whose tokens are scheduled).

        A block whose content another block already holds is not registered:
        the cached copy is touched and queued in `seq.merges`, to replace ours
        after the step, so identical content is never held twice.
        """
        pool = self.pool
        index = self.index
        held = seq.kv_blocks[self.group_id]
        hashes = seq.block_hashes
        tokens = seq.token_ids
        bs = self.block_size
        first_extra, other_extra = seq.extra_keys
        parent = held[start - 1].cache_id if start else ROOT_CACHE_ID
        for i in range(start, end):
            block_hash = hashes[i]
            block_tokens = tokens[i * bs : (i + 1) * bs]
            extra = other_extra if i else first_extra
            existing = index.get(block_hash)
            if existing is None:
                block = held[i]
                pool.register(self.group_id, block, block_hash, block_tokens, extra, parent, False)
                parent = block.cache_id
            elif existing is held[i]:
                parent = existing.cache_id
            elif (
                existing.token_ids == block_tokens
                and existing.parent_cache_id == parent
                and existing.extra == extra
            ) or not self.verify:
                pool.touch((existing,))
                seq.merges.append((self.group_id, i, existing))
                parent = existing.cache_id
            else:
                # A collision: this content cannot be indexed, nor anything chained to it.
                seq.cache_chain_broken = True
                break
