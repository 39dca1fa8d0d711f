"""Independent accounting: the ideal prefill and held duplicate blocks.

It hashes content with its own hasher and reads only block ids (the tables
the manager reports after each step, through its public `block_ids`), so it
checks the manager rather than trusting it.
"""

from __future__ import annotations

from collections.abc import Callable

from kvserve.engine.request import Request
from kvserve.engine.scheduler import SchedulerOutput
from kvserve.kvcache.hashing import BlockHasher, extra_key_bytes
from kvserve.kvcache.specs import KVCacheSpec, SlidingWindowSpec

TablesOf = Callable[[str], list[list[int]]]
"""Request id -> its block ids per group now (empty tables once it let them go)."""


class ContentTracker:
    """Knows which full blocks an exact, unlimited cache would hold.

    `ideal_prefill_tokens`: per request, at its first admission, the prompt
    tokens not covered by leading full blocks already seen (computed before,
    or admitted earlier in the same step); at least one token.
    `duplicates`: held physical blocks whose computed content another held
    block also holds, after each step.
    """

    def __init__(
        self,
        block_size: int,
        group_ratios: list[int | None] | None = None,
        has_windows: bool = False,
    ) -> None:
        """`group_ratios`: per group, hash blocks per physical block (None: a state
        group, whose per-request state is no shared content); default 1 group of 1.
        `has_windows`: a sliding window releases blocks, so tables are read each step."""
        self.block_size = block_size
        self.group_ratios = group_ratios or [1]
        self.has_windows = has_windows
        self._hasher = BlockHasher(block_size, "xxh3_128", seed=12345)
        self._seen: set[bytes] = set()
        self._hashes: dict[str, list[bytes]] = {}
        self._recorded: dict[str, list[list[tuple[tuple[int, bytes], int] | None]]] = {}
        """Per request, per group: (content key, block id) of each full computed block,
        None once released out of a sliding window."""
        self._num_recorded: dict[str, int] = {}
        self._first_held: dict[str, list[int]] = {}
        self._holders: dict[tuple[int, bytes], dict[int, int]] = {}
        self.ideal_prefill_tokens = 0
        self.duplicates = 0
        self.duplicates_peak = 0

    def _content(self, req: Request) -> list[bytes]:
        hashes = self._hashes.setdefault(req.request_id, [])
        self._hasher.extend(hashes, req.token_ids, extra_key_bytes(req.lora_name, req.cache_salt))
        return hashes

    def admitted(self, req: Request) -> None:
        """First admission of `req`: count its ideal prefill, mark its prompt seen."""
        hashes = self._content(req)
        prompt_blocks = hashes[: req.num_prompt_tokens // self.block_size]
        seen = self._seen
        lead = 0
        for h in prompt_blocks:
            if h not in seen:
                break
            lead += 1
        self.ideal_prefill_tokens += max(1, req.num_prompt_tokens - lead * self.block_size)
        seen.update(prompt_blocks)

    def after_step(self, out: SchedulerOutput, tables_of: TablesOf) -> None:
        """Record the full computed blocks each scheduled request now holds.

        A request that finished in this step holds nothing any more: what it
        computed is seen, and it is released before anyone else's blocks are
        recorded. (Recorded after them, its window blocks released early in the
        step, which its empty tables no longer show, still counted as held: a
        request hitting less than them and computing that content again was
        counted as a duplicate it never was.)
        """
        bs = self.block_size
        seen = self._seen
        ratios = self.group_ratios
        num_groups = len(ratios)
        for chunk in out.chunks:
            req = chunk.request
            if req.status.finished:
                seen.update(self._content(req)[: req.num_computed_tokens // bs])
                self.released(req)
        for chunk in out.chunks:
            req = chunk.request
            if req.status.finished:
                continue
            rid = req.request_id
            done = self._num_recorded.get(rid, 0)
            full = req.num_computed_tokens // bs
            if full <= done and not self.has_windows:
                continue
            tables = tables_of(rid)
            recorded = self._recorded.get(rid)
            if recorded is None:
                recorded = self._recorded[rid] = [[] for _ in range(num_groups)]
            # Blocks a sliding window released (leading null entries) are no longer held.
            firsts = self._first_held.setdefault(rid, [0] * num_groups)
            for group, table in enumerate(tables):
                entries = recorded[group]
                i = firsts[group]
                while i < len(entries) and i < len(table) and not table[i]:
                    entry = entries[i]
                    if entry is not None:
                        self._drop(entry)
                        entries[i] = None
                    i += 1
                firsts[group] = i
            if full <= done:
                continue
            hashes = self._content(req)
            for i in range(done, full):
                content = hashes[i]
                seen.add(content)
                for group in range(num_groups):
                    k = ratios[group]
                    if k is None or (i + 1) % k:
                        continue  # a state group, or the physical block is not full yet
                    m = i // k
                    # Finished in this step (computed, already freed): nothing held.
                    table = tables[group] if group < len(tables) else []
                    if m >= len(table) or not table[m]:
                        recorded[group].append(None)
                        continue
                    entry = ((group, content), table[m])
                    recorded[group].append(entry)
                    holders = self._holders.setdefault(entry[0], {})
                    if entry[1] not in holders and holders:
                        self.duplicates += 1
                    holders[entry[1]] = holders.get(entry[1], 0) + 1
            self._num_recorded[rid] = full
        if self.duplicates > self.duplicates_peak:
            self.duplicates_peak = self.duplicates

    def _drop(self, entry: tuple[tuple[int, bytes], int]) -> None:
        content, block_id = entry
        holders = self._holders[content]
        holders[block_id] -= 1
        if not holders[block_id]:
            del holders[block_id]
            if holders:
                self.duplicates -= 1
        if not holders:
            del self._holders[content]

    def released(self, req: Request) -> None:
        """`req` gave back its blocks (finished or preempted)."""
        for entries in self._recorded.pop(req.request_id, ()):
            for entry in entries:
                if entry is not None:
                    self._drop(entry)
        self._num_recorded.pop(req.request_id, None)
        self._first_held.pop(req.request_id, None)
        if req.status.finished:
            self._hashes.pop(req.request_id, None)


def tracker_for(specs: list[KVCacheSpec], hash_block_size: int) -> ContentTracker:
    """A tracker for these groups: hash blocks per physical block (None: a state group)."""
    ratios = [None if s.kind == "mamba" else s.block_size // hash_block_size for s in specs]
    windows = any(isinstance(s, SlidingWindowSpec) for s in specs)
    return ContentTracker(hash_block_size, ratios, windows)
