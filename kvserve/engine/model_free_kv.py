"""The model-free runner's K/V, kept only when `simulate` runs external tiers.

Without a model, the "K/V" of a position is its token id: the runner writes
each computed token into its slot of every attention group's block, copies
slots as the plan's copy-on-write says, and, the first time a request runs
after (re)admission or a hit in a later chunk, checks that every position
before its chunk holds the request's token: what a hit, a copy or a load
from a tier put there must be the request's own prefix. A wrong block
loaded from a tier fails the run instead of going unnoticed.

Payloads are `bytes_per_token` bytes per token (the size a stated model's
K/V would take, so tier capacities in bytes mean what they would mean for
it): the token ids as uint32, then zeros. A state group's page (Mamba) is
`bytes_per_token` x its page tokens of zeros: state is not modelled, only
its size and where it goes.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence

from kvserve.batch import SeqChunk
from kvserve.kvcache.specs import KVCacheSpec

EMPTY = -1
"""A slot nothing was written to."""


class ModelFreeKV:
    """Token ids per attention slot; the block reader/writer the offload connector uses."""

    def __init__(self, specs: list[KVCacheSpec], bytes_per_token: int) -> None:
        if bytes_per_token < 4:
            raise ValueError(
                f"kv bytes per token must be >= 4 (a token id is 4 bytes), got {bytes_per_token}"
            )
        self.specs = specs
        self.bytes_per_token = bytes_per_token
        self.attention = [g for g, s in enumerate(specs) if s.kind != "mamba"]
        self._slots: dict[tuple[int, int], list[int]] = {}
        self._next: dict[str, int] = {}
        """Request id -> the position after its last chunk (continuing chunks need no check)."""
        self.checked_positions = 0

    def fingerprint(self, hash_block_size: int, hash_fn: str, hash_seed: int) -> bytes:
        """32 bytes naming what a stored payload means (keys a disk tier's files)."""
        described = {
            "model": "model-free",
            "bytes_per_token": self.bytes_per_token,
            "specs": [repr(s) for s in self.specs],
            "hash_block_size": hash_block_size,
            "hash_fn": hash_fn,
            "hash_seed": hash_seed,
        }
        return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).digest()

    def _block(self, group: int, block: int) -> list[int]:
        slots = self._slots.get((group, block))
        if slots is None:
            slots = self._slots[(group, block)] = [EMPTY] * self.specs[group].block_size
        return slots

    # -- the runner's step --------------------------------------------------------

    def run(self, chunk: SeqChunk) -> None:
        """Copies, the check of what the chunk reads, then the K/V it computes."""
        plan = chunk.plan
        for op in plan.copies:
            src = self._block(op.group, op.src_block)
            dst = self._block(op.group, op.dst_block)
            n = op.num_tokens
            dst[op.dst_offset : op.dst_offset + n] = src[op.src_offset : op.src_offset + n]
        tokens = chunk.token_ids
        if self._next.get(chunk.request_id) != plan.start:
            self._check(chunk.request_id, tokens, plan.block_ids, plan.start)
        for g in self.attention:
            size = self.specs[g].block_size
            table = plan.block_ids[g]
            for p in range(max(plan.start, plan.skip_write_until), plan.end):
                block = table[p // size]
                if block:
                    self._block(g, block)[p % size] = tokens[p]
        self._next[chunk.request_id] = plan.end

    def _check(self, request_id: str, tokens: Sequence[int], tables: tuple, end: int) -> None:
        for g in self.attention:
            size = self.specs[g].block_size
            table = tables[g]
            for p in range(end):
                block = table[p // size]
                if not block:  # released by a sliding window: never read
                    continue
                held = self._block(g, block)[p % size]
                if held != tokens[p]:
                    raise AssertionError(
                        f"request {request_id}: group {g} block {block} holds token {held} "
                        f"at position {p}, the request has {tokens[p]}"
                    )
            self.checked_positions += end

    def free_request(self, request_id: str) -> None:
        self._next.pop(request_id, None)

    # -- the connector's BlockIO ----------------------------------------------------

    def payload_bytes(self, group: int, num: int | None = None) -> int:
        """The size of what `read(group, block, 0, num)` returns, without reading."""
        return self.bytes_per_token * (self.specs[group].block_size if num is None else num)

    def read(self, group: int, block: int, offset: int = 0, num: int | None = None) -> bytes:
        """Slots [offset, offset + num) of `block` (a whole state page when num is None)."""
        if self.specs[group].kind == "mamba":
            return bytes(self.bytes_per_token * self.specs[group].block_size)
        num = self.specs[group].block_size - offset if num is None else num
        ids = self._block(group, block)[offset : offset + num]
        packed = struct.pack(f"<{num}I", *(t & 0xFFFFFFFF for t in ids))
        return packed + bytes(self.bytes_per_token * num - len(packed))

    def write(
        self, group: int, block: int, data: bytes, offset: int = 0, num: int | None = None
    ) -> None:
        """The inverse of `read`; a payload of the wrong size is a ValueError."""
        size = self.specs[group].block_size
        num = size - offset if num is None else num
        if len(data) != self.bytes_per_token * num:
            raise ValueError(
                f"payload of {len(data)} bytes for {num} tokens of {self.bytes_per_token} bytes"
            )
        if self.specs[group].kind == "mamba":
            return
        slots = self._block(group, block)
        slots[offset : offset + num] = struct.unpack_from(f"<{num}I", data)
