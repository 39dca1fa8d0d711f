"""KV cache events: what a router needs to know what each engine would hit.

The structures, field names and wire encoding are vLLM's (msgpack via
msgspec): a batch is an array `[ts, events, data_parallel_rank]`, each event a
map tagged `"type"`. Fields without a default are always on the wire (a vLLM
decoder requires them); the others are left out when None.

Block hashes are, by default, 64-bit unsigned ints derived as vLLM does it:
the last 8 bytes of our digest read big-endian (`int.from_bytes(h, "big") &
(2**64 - 1)`). With `int_block_hashes=False` the full digest goes out as
msgpack bytes. One hash always stands for one hash block (`block_size`
tokens of `token_ids`), whatever the physical block size.
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM_GPU = "GPU"
"""The device pool. The CPU runner's pool says "GPU" too: it is the engine's
primary KV pool, which is what routers key on (offload tiers will say "CPU")."""

WireHash = int | bytes

_MASK64 = (1 << 64) - 1


def wire_hash(block_hash: bytes, int_block_hashes: bool = True) -> WireHash:
    """Our bytes digest as it goes on the wire (u64 by default, see module doc)."""
    if int_block_hashes:
        return int.from_bytes(block_hash[-8:], "big")
    return block_hash


def wire_hash_u64(block_hash: bytes) -> int:
    """Same as `wire_hash(h)`, spelled as vLLM spells it (for documentation and tests)."""
    return int.from_bytes(block_hash, "big") & _MASK64


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged union: encoded as a map with `"type": <class name>`."""


class BlockStored(KVCacheEvent):
    """A run of consecutive hash blocks of one group became cached.

    `parent_block_hash` is the hash of the block before the first one (None for
    a request's first block); `token_ids` holds `block_size` tokens per hash.
    """

    block_hashes: list[WireHash]
    parent_block_hash: WireHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    """Cached hash blocks of one group were evicted: a hit can no longer use them."""

    block_hashes: list[WireHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    """The prefix cache was reset: nothing is cached any more."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The events of one engine step, in the order they happened."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    return _decoder.decode(payload)
