"""A router's view of what each engine holds, and the hit each engine would report.

`PrefixIndex.apply(engine, batch)` replays an engine's events; `match(tokens)`
hashes the request as that engine does (metadata: hash function, seed, hash
block size) and applies the engine's rules (KVCacheManager.get_computed_blocks):

- the anchor (first full-attention) group: the longest run of cached blocks
  from the left whose verification links hold;
- each sliding-window group may only shorten that candidate, to the largest
  end whose window blocks are cached (a fixed point over the groups);
- the hit is aligned to hash blocks, and never covers the last token.

Verification links mirror the engine's: a block is usable only while the
registration it was chained to (its parent; for a sliding window, the
full-attention block at the same position) is still the one cached. Each
`BlockStored` gets a fresh generation number standing for the engine's
registration id, so a parent evicted and stored again breaks the link exactly
as it does in the engine.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from kvserve.kvcache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    wire_hash,
)
from kvserve.kvcache.hashing import BlockHasher, extra_key_bytes

ROOT = -1
"""Link of a request's first block (the engine's ROOT_CACHE_ID)."""
DEAD = 0
"""Link to a registration that is not cached (never equal to a generation)."""


@dataclass(slots=True)
class EngineView:
    """One engine: per group, wire hash -> (generation, link)."""

    metadata: dict[str, Any]
    groups: list[dict[Any, tuple[int, int]]]
    anchor: int | None
    windows: list[tuple[int, int]]
    """(group index, sliding window) of every other group."""
    verify: bool
    int_hashes: bool
    next_gen: int = 1
    batches: int = 0

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> EngineView:
        groups = metadata["groups"]
        anchor = metadata.get("anchor_group")
        windows = [
            (g["group_idx"], g["sliding_window"])
            for g in groups
            if g["group_idx"] != anchor and g["kind"] == "sliding_window"
        ]
        return cls(
            metadata,
            [{} for _ in groups],
            anchor,
            windows,
            bool(metadata.get("verify_hits", True)),
            not str(metadata.get("block_hash_encoding", "u64")).startswith("bytes"),
        )

    @property
    def num_blocks(self) -> int:
        return sum(len(g) for g in self.groups)

    def clear(self) -> None:
        for g in self.groups:
            g.clear()

    def apply(self, batch: KVEventBatch) -> None:
        self.batches += 1
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                group = self.groups[event.group_idx or 0]
                for h in event.block_hashes:
                    group.pop(h, None)
            elif isinstance(event, AllBlocksCleared):
                self.clear()

    def _stored(self, event: BlockStored) -> None:
        g = event.group_idx or 0
        group = self.groups[g]
        anchor = self.groups[self.anchor] if self.anchor is not None else None
        if g == self.anchor:
            if event.parent_block_hash is None:
                link = ROOT
            else:
                parent = group.get(event.parent_block_hash)
                link = parent[0] if parent is not None else DEAD
            for h in event.block_hashes:
                gen = self.next_gen
                self.next_gen += 1
                group[h] = (gen, link)
                link = gen
        else:
            for h in event.block_hashes:
                gen = self.next_gen
                self.next_gen += 1
                a = anchor.get(h) if anchor is not None else None
                group[h] = (gen, a[0] if a is not None else DEAD)

    def hit_tokens(self, hashes: list[Any], num_tokens: int) -> int:
        """The engine's `get_computed_blocks(seq, 0).num_tokens` for these hashes."""
        bs = self.metadata["hash_block_size"]
        if not self.metadata.get("enable_prefix_caching", True) or num_tokens <= 1:
            return 0
        candidate = num_tokens // bs
        anchor_gens: list[int] = []
        if self.anchor is not None:
            group = self.groups[self.anchor]
            link = ROOT
            for i in range(candidate):
                entry = group.get(hashes[i])
                if entry is None or (self.verify and entry[1] != link):
                    break
                anchor_gens.append(entry[0])
                link = entry[0]
            candidate = len(anchor_gens)
        if candidate and self.windows:
            candidate = self._windows_fixed_point(hashes, candidate, anchor_gens, num_tokens)
        if not candidate:
            return 0
        end = candidate * bs
        return num_tokens - 1 if end >= num_tokens else end

    def _windows_fixed_point(
        self, hashes: list[Any], candidate: int, anchor_gens: list[int], num_tokens: int
    ) -> int:
        """Largest candidate every window accepts (SlidingWindowGroup.find_window_hit).

        A hit at block k needs the blocks holding keys [end - W + 1, end), where
        end = k * block_size, or num_tokens - 1 when the hit covers every token
        (that last token is recomputed and reads its own window).
        """
        bs = self.metadata["hash_block_size"]
        has_anchor = self.anchor is not None
        while True:
            stable = True
            for g, window in self.windows:
                group = self.groups[g]

                def ok(i: int, group: dict = group) -> bool:
                    entry = group.get(hashes[i])
                    if entry is None:
                        return False
                    return not (self.verify and has_anchor and entry[1] != anchor_gens[i])

                k = candidate
                while k > 0:
                    first_key = min(k * bs, num_tokens - 1) - window + 1
                    lo = first_key // bs if first_key > 0 else 0
                    missing = next((i for i in range(k - 1, lo - 1, -1) if not ok(i)), None)
                    if missing is None:
                        break
                    k = missing
                if k < candidate:
                    candidate = k
                    stable = False
            if stable or candidate == 0:
                return candidate


@dataclass(slots=True)
class PrefixIndex:
    """Per-engine views fed by subscribers; `match` answers for every engine at once."""

    engines: dict[Hashable, EngineView] = field(default_factory=dict)
    _hashers: dict[tuple, BlockHasher] = field(default_factory=dict)

    def add_engine(self, engine: Hashable, metadata: dict[str, Any]) -> EngineView:
        view = self.engines.get(engine)
        if view is None or view.metadata != metadata:
            view = self.engines[engine] = EngineView.from_metadata(metadata)
        return view

    def apply(self, engine: Hashable, batch: KVEventBatch) -> None:
        self.engines[engine].apply(batch)

    def match(
        self, token_ids: list[int], extra_keys: dict[str, str | None] | None = None
    ) -> dict[Hashable, int]:
        """Prefix hit tokens each engine would report for this request at admission.

        `extra_keys`: {"lora_name": ..., "cache_salt": ...} as the request carries them.
        """
        extra = extra_keys or {}
        keys = extra_key_bytes(extra.get("lora_name"), extra.get("cache_salt"))
        hashes_by_recipe: dict[tuple, list[Any]] = {}
        result: dict[Hashable, int] = {}
        for engine, view in self.engines.items():
            m = view.metadata
            recipe = (m["hash_fn"], m["hash_seed"], m["hash_block_size"], view.int_hashes)
            hashes = hashes_by_recipe.get(recipe)
            if hashes is None:
                hasher = self._hashers.get(recipe[:3])
                if hasher is None:
                    hasher = self._hashers[recipe[:3]] = BlockHasher(
                        m["hash_block_size"], m["hash_fn"], m["hash_seed"]
                    )
                raw: list[bytes] = []
                hasher.extend(raw, token_ids, keys)
                hashes = hashes_by_recipe[recipe] = [wire_hash(h, view.int_hashes) for h in raw]
            result[engine] = view.hit_tokens(hashes, len(token_ids))
        return result
