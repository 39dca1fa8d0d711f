"""Checks every batch a subscriber applies: the stream's own rules, independent of the index."""

from __future__ import annotations

from kvserve.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvserve.kvcache.hashing import BlockHasher

KINDS = ("full_attention", "sliding_window", "mamba")


class StreamChecker:
    """No hash stored twice per group without a removal between; token ids line up; parents chain.

    `block_size` (the hash block size) is what every BlockStored must carry,
    inflated physical blocks or not. A full-attention run's parent must be
    cached in its group (state snapshots and windows name the previous hash
    block, which their own group need not hold). With bytes hashes (`hasher`
    given) each stored hash is recomputed from its parent and its tokens, so
    hashes, parents and token ids must all agree, in every group.
    """

    def __init__(self, hasher: BlockHasher | None = None, block_size: int | None = None) -> None:
        self.hasher = hasher
        self.block_size = block_size if hasher is None else hasher.block_size
        self.stored: dict[int, set] = {}
        self.num_stored = self.num_removed = self.num_cleared = 0
        self.stored_by_kind: dict[str, int] = {}

    def __call__(self, seq: int, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                held = self.stored.setdefault(event.group_idx, set())
                for h in event.block_hashes:
                    assert h in held, f"batch {seq}: removed a hash that is not stored"
                    held.remove(h)
                    self.num_removed += 1
            elif isinstance(event, AllBlocksCleared):
                self.stored.clear()
                self.num_cleared += 1

    def _stored(self, e: BlockStored) -> None:
        held = self.stored.setdefault(e.group_idx, set())
        assert len(e.token_ids) == len(e.block_hashes) * e.block_size
        if self.block_size is not None:
            assert e.block_size == self.block_size, "block_size is not the hash block size"
        assert e.medium == "GPU" and e.kv_cache_spec_kind in KINDS
        assert (e.kv_cache_spec_sliding_window is None) == (
            e.kv_cache_spec_kind != "sliding_window"
        )
        for h in e.block_hashes:
            assert h not in held, "a hash stored twice without a removal in between"
            held.add(h)
            self.num_stored += 1
        kind = e.kv_cache_spec_kind
        self.stored_by_kind[kind] = self.stored_by_kind.get(kind, 0) + len(e.block_hashes)
        if kind == "full_attention" and e.parent_block_hash is not None:
            assert e.parent_block_hash in held, "the parent of a stored run is not cached"
        if self.hasher is not None:
            bs = e.block_size
            parent = self.hasher.root if e.parent_block_hash is None else e.parent_block_hash
            for i, h in enumerate(e.block_hashes):
                tokens = e.token_ids[i * bs : (i + 1) * bs]
                assert self.hasher.hash_block(parent, tokens) == h, "hash, parent, tokens disagree"
                parent = h
