"""Checks every batch a subscriber applies: the stream's own rules, independent of the index."""

from __future__ import annotations

from kvserve.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvserve.kvcache.hashing import BlockHasher


class StreamChecker:
    """No hash stored twice without a removal between; token ids line up; parents chain.

    With bytes hashes (`hasher` given) each stored hash is recomputed from its
    parent and its tokens, so hashes, parents and token ids must all agree.
    """

    def __init__(self, hasher: BlockHasher | None = None) -> None:
        self.hasher = hasher
        self.stored: dict[int, set] = {}
        self.num_stored = self.num_removed = self.num_cleared = 0

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
        assert e.medium == "GPU" and e.kv_cache_spec_kind in ("full_attention", "sliding_window")
        for h in e.block_hashes:
            assert h not in held, "a hash stored twice without a removal in between"
            held.add(h)
            self.num_stored += 1
        if e.group_idx == 0 and e.parent_block_hash is not None:
            assert e.parent_block_hash in held, "the parent of a stored run is not cached"
        if self.hasher is not None:
            bs = e.block_size
            parent = self.hasher.root if e.parent_block_hash is None else e.parent_block_hash
            for i, h in enumerate(e.block_hashes):
                tokens = e.token_ids[i * bs : (i + 1) * bs]
                assert self.hasher.hash_block(parent, tokens) == h, "hash, parent, tokens disagree"
                parent = h
