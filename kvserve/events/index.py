"""A router's view of what each engine holds, and the hit each engine would report.

`PrefixIndex.apply(engine, batch)` replays an engine's events; `match(tokens)`
hashes the request as that engine does (metadata: hash function, seed, hash
block size) and applies the engine's rules (KVCacheManager.get_computed_blocks):

- the anchor (first full-attention) group: the longest run of cached blocks
  from the left whose verification links hold; every other full-attention
  group may only shorten it to its own run;
- each sliding-window group may only shorten that candidate, to the largest
  end whose window blocks are cached (a fixed point over the groups);
- the hit is aligned to hash blocks, and never covers the last token.

Models with state (Mamba) groups follow StateCoordinator.lookup instead: the
candidate is `(len - 1) // hash_block_size` hash blocks (the last token is
always computed, and a state can only resume before it), attention groups
accept any prefix of their runs (hash granularity, whatever the physical
block size), and every state group needs a snapshot after exactly the hit's
last hash block: the hit is the largest such end, `c * hash_block_size`.

Verification links mirror the engine's: a block is usable only while the
registration it was chained to (its parent in its own group for full
attention; for a sliding window or a state snapshot, the anchor group's
block at the same hash) is still the one cached. Each `BlockStored` gets a
fresh generation number standing for the engine's registration id, so a
parent evicted and stored again breaks the link exactly as it does in the
engine.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from kvserve.kvcache.events import (
    MEDIUM_GPU,
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


def _verified_against(group: dict[str, Any]) -> str:
    """What a group's blocks verify against: "parent" (in its own group) or "anchor".

    "anchor" is the anchor group's block at the same hash. Metadata says so;
    older metadata lacks the key, and then only full attention chains.
    """
    default = "parent" if group["kind"] == "full_attention" else "anchor"
    return group.get("verified_against", default)


@dataclass(slots=True)
class EngineView:
    """One engine: per group, wire hash -> (generation, link)."""

    metadata: dict[str, Any]
    groups: list[dict[Any, tuple[int, int]]]
    anchor: int | None
    windows: list[tuple[int, int]]
    """(group index, sliding window) of every sliding-window group."""
    verify: bool
    int_hashes: bool
    chained: list[int] = field(default_factory=list)
    """Full-attention groups other than the anchor: each its own run from the left."""
    states: list[int] = field(default_factory=list)
    """State (Mamba) groups: hits only where a snapshot was taken."""
    next_gen: int = 1
    batches: int = 0
    tiers: dict[str, set[tuple[int, Any]]] = field(default_factory=dict)
    """Medium ("CPU", "STORAGE") -> (group, hash) the engine's external tiers hold: what
    it loads after its pool's hit, and what a KV transfer producer serves."""

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> EngineView:
        groups = metadata["groups"]
        anchor = metadata.get("anchor_group")
        others = [g for g in groups if g["group_idx"] != anchor]
        return cls(
            metadata,
            [{} for _ in groups],
            anchor,
            [
                (g["group_idx"], g["sliding_window"])
                for g in others
                if g["kind"] == "sliding_window"
            ],
            bool(metadata.get("verify_hits", True)),
            not str(metadata.get("block_hash_encoding", "u64")).startswith("bytes"),
            chained=[g["group_idx"] for g in others if _verified_against(g) == "parent"],
            states=[g["group_idx"] for g in others if g["kind"] == "mamba"],
        )

    @property
    def num_blocks(self) -> int:
        return sum(len(g) for g in self.groups)

    def clear(self) -> None:
        for g in self.groups:
            g.clear()
        self.tiers.clear()

    def apply(self, batch: KVEventBatch) -> None:
        self.batches += 1
        for event in batch.events:
            medium = getattr(event, "medium", None)
            if medium is not None and medium != MEDIUM_GPU:
                held = self.tiers.setdefault(medium, set())
                group = getattr(event, "group_idx", None) or 0
                if isinstance(event, BlockStored):
                    held.update((group, h) for h in event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    held.difference_update((group, h) for h in event.block_hashes)
                continue
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
        if g == self.anchor or g in self.chained or self.anchor is None:
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
            anchor = self.groups[self.anchor]
            for h in event.block_hashes:
                gen = self.next_gen
                self.next_gen += 1
                a = anchor.get(h)
                group[h] = (gen, a[0] if a is not None else DEAD)

    def _run(self, g: int, hashes: list[Any], limit: int) -> list[int]:
        """Generations of group g's verified run of hits from the left (at most `limit`)."""
        group = self.groups[g]
        gens: list[int] = []
        link = ROOT
        for i in range(limit):
            entry = group.get(hashes[i])
            if entry is None or (self.verify and entry[1] != link):
                break
            gens.append(entry[0])
            link = entry[0]
        return gens

    def hit_tokens(self, hashes: list[Any], num_tokens: int) -> int:
        """The engine's `get_computed_blocks(seq, 0).num_tokens` for these hashes."""
        bs = self.metadata["hash_block_size"]
        if not self.metadata.get("enable_prefix_caching", True) or num_tokens <= 1:
            return 0
        if self.states:
            return self._state_hit(hashes, num_tokens) * bs
        candidate = num_tokens // bs
        anchor_gens: list[int] = []
        if self.anchor is not None:
            anchor_gens = self._run(self.anchor, hashes, candidate)
            candidate = len(anchor_gens)
        for g in self.chained:
            candidate = len(self._run(g, hashes, candidate))
        if candidate and self.windows:
            candidate = self._windows_fixed_point(hashes, candidate, anchor_gens, num_tokens)
        if not candidate:
            return 0
        end = candidate * bs
        return num_tokens - 1 if end >= num_tokens else end

    def held_in_tiers(self) -> set[tuple[int, Any]]:
        return set().union(*self.tiers.values()) if self.tiers else set()

    def tier_run(
        self, hashes: list[Any], num_tokens: int, local: int, held: set[tuple[int, Any]]
    ) -> int:
        """Tokens an engine loads from external tiers after its pool's hit of `local`
        (kvserve.offload.connector.lookup): hash blocks from there while every attention
        group's block is `held`, ended where every state group holds a snapshot."""
        hb = self.metadata["hash_block_size"]
        if not held or local % hb:
            return 0
        start = end = local // hb
        limit = min((num_tokens - 1) // hb, len(hashes))
        kinds = [(g["group_idx"], g["kind"] == "mamba") for g in self.metadata["groups"]]
        attention = [g for g, state in kinds if not state]
        states = [g for g, state in kinds if state]
        while end < limit and all((g, hashes[end]) in held for g in attention):
            end += 1
        while end > start and not all((g, hashes[end - 1]) in held for g in states):
            end -= 1
        return (end - start) * hb

    def _state_hit(self, hashes: list[Any], num_tokens: int) -> int:
        """Hash blocks of a state model's hit (StateCoordinator.lookup, between steps).

        Attention groups accept any prefix of their runs, so the fixed point is
        the largest end, within every run, after which each state group holds
        a snapshot verified against the anchor run's block at that hash.
        """
        candidate = (num_tokens - 1) // self.metadata["hash_block_size"]
        if candidate <= 0 or self.anchor is None:
            return 0
        anchor_gens = self._run(self.anchor, hashes, candidate)
        candidate = len(anchor_gens)
        for g in self.chained:
            candidate = len(self._run(g, hashes, candidate))
        states = [self.groups[g] for g in self.states]
        for c in range(candidate, 0, -1):
            h, gen = hashes[c - 1], anchor_gens[c - 1]
            if all(
                (s := group.get(h)) is not None and (not self.verify or s[1] == gen)
                for group in states
            ):
                return c
        return 0

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
        """Prefix hit tokens each engine would report for this request at admission: its
        pool's hit, then what it would load from its tiers and its producers' (a KV
        transfer consumer reads the tiers of the engines whose `serves` it `reads`).

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
            local = view.hit_tokens(hashes, len(token_ids))
            held = view.held_in_tiers()
            for producer in self._producers(view):
                held |= producer.held_in_tiers()
            result[engine] = local + view.tier_run(hashes, len(token_ids), local, held)
        return result

    def _producers(self, view: EngineView) -> list[EngineView]:
        """The engines whose tiers `view`'s engine pulls from (kvserve.transfer)."""
        reads = (view.metadata.get("kv_transfer") or {}).get("reads") or []
        if not reads:
            return []
        out = []
        for other in self.engines.values():
            serves = (other.metadata.get("kv_transfer") or {}).get("serves")
            if other is not view and serves and any(_same_endpoint(serves, r) for r in reads):
                out.append(other)
        return out


def _same_endpoint(serves: str, peer: str) -> bool:
    """A producer bound to every address (0.0.0.0, *) is any host's at its port."""
    host, _, port = serves.removeprefix("tcp://").rpartition(":")
    if host in ("0.0.0.0", "*", "[::]"):
        return peer.rpartition(":")[2] == port
    return serves == peer
