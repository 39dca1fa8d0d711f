"""Independent accounting: the ideal prefill and held duplicate blocks.

It hashes content with its own hasher and reads only block tables, so it
checks the manager rather than trusting it.
"""

from __future__ import annotations

from kvserve.engine.request import Request
from kvserve.engine.scheduler import SchedulerOutput
from kvserve.kvcache.hashing import BlockHasher


class ContentTracker:
    """Knows which full blocks an exact, unlimited cache would hold.

    `ideal_prefill_tokens`: per request, at its first admission, the prompt
    tokens not covered by leading full blocks already seen (computed before,
    or admitted earlier in the same step); at least one token.
    `duplicates`: held physical blocks whose computed content another held
    block also holds, after each step.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._hasher = BlockHasher(block_size, "xxh3_128", seed=12345)
        self._seen: set[bytes] = set()
        self._hashes: dict[str, list[bytes]] = {}
        self._recorded: dict[str, list[tuple[bytes, int]]] = {}
        self._holders: dict[bytes, dict[int, int]] = {}
        self.ideal_prefill_tokens = 0
        self.duplicates = 0
        self.duplicates_peak = 0

    def _content(self, req: Request) -> list[bytes]:
        hashes = self._hashes.setdefault(req.request_id, [])
        self._hasher.extend(hashes, req.token_ids, req.extra_keys)
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

    def after_step(self, out: SchedulerOutput) -> None:
        """Record the full computed blocks each scheduled request now holds."""
        bs = self.block_size
        seen = self._seen
        for chunk in out.chunks:
            req = chunk.request
            recorded = self._recorded.setdefault(req.request_id, [])
            full = req.num_computed_tokens // bs
            if full <= len(recorded):
                continue
            hashes = self._content(req)
            table = req.kv_blocks[0]
            for i in range(len(recorded), full):
                content = hashes[i]
                seen.add(content)
                if i >= len(table):  # finished in this step: computed, already freed
                    continue
                block_id = table[i].block_id
                recorded.append((content, block_id))
                holders = self._holders.setdefault(content, {})
                if block_id not in holders and holders:
                    self.duplicates += 1
                holders[block_id] = holders.get(block_id, 0) + 1
        if self.duplicates > self.duplicates_peak:
            self.duplicates_peak = self.duplicates

    def released(self, req: Request) -> None:
        """`req` gave back its blocks (finished or preempted)."""
        for content, block_id in self._recorded.pop(req.request_id, ()):
            holders = self._holders[content]
            holders[block_id] -= 1
            if not holders[block_id]:
                del holders[block_id]
                if holders:
                    self.duplicates -= 1
            if not holders:
                del self._holders[content]
        if req.status.finished:
            self._hashes.pop(req.request_id, None)
