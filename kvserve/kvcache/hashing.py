"""Chained block hashes: the identity of a hash block's KV.

A block's hash covers its parent's hash, its token ids and the request's extra
keys, so equal hashes mean equal prefixes. The root is derived from a seed, not
from the process, so engines on different machines agree (LMCache #1139).
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import xxhash

HASH_FUNCTIONS: dict[str, Callable[[bytes], bytes]] = {
    "sha256": lambda data: hashlib.sha256(data).digest(),
    "xxh3_128": xxhash.xxh3_128_digest,
}


class _HashObject(Protocol):
    def digest(self) -> bytes: ...


_HASH_OBJECTS: dict[str, Callable[[bytes], _HashObject]] = {
    "sha256": hashlib.sha256,
    "xxh3_128": xxhash.xxh3_128,
}
"""The same functions as hash objects (`.digest()`): `extend`'s loop calls them without a
Python-level wrapper, a tenth of a block's hashing cost on long prompts."""

DEFAULT_HASH = "sha256"
DEFAULT_SEED = 0


def extra_key_bytes(lora_name: str | None, cache_salt: str | None) -> tuple[bytes, bytes]:
    """Extra keys as (first block, other blocks) suffixes.

    The salt only enters the first block: every later hash chains from it, so
    tenants diverge from the root. The LoRA name enters every block. Each part
    is length-prefixed so no two key sets encode alike.
    """
    lora = b"" if lora_name is None else b"L" + _with_len(lora_name.encode())
    salt = b"" if cache_salt is None else b"S" + _with_len(cache_salt.encode())
    return salt + lora, lora


def _with_len(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


class BlockHasher:
    """Hashes `block_size`-token chunks, each chained to its parent.

    `hash_fn` may be a name in HASH_FUNCTIONS or any bytes -> bytes callable
    (tests inject weak ones to provoke collisions).
    """

    __slots__ = (
        "_blocks_of",
        "_digest",
        "_new",
        "_pack",
        "block_size",
        "hash_name",
        "root",
        "seed",
    )

    def __init__(
        self,
        block_size: int,
        hash_fn: str | Callable[[bytes], bytes] = DEFAULT_HASH,
        seed: int = DEFAULT_SEED,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if isinstance(hash_fn, str):
            if hash_fn not in HASH_FUNCTIONS:
                raise ValueError(
                    f"unknown hash function {hash_fn!r}; choose one of {sorted(HASH_FUNCTIONS)}"
                )
            self.hash_name = hash_fn
            self._digest = HASH_FUNCTIONS[hash_fn]
            self._new: Callable[[bytes], _HashObject] | None = _HASH_OBJECTS[hash_fn]
        else:
            self._new = None
            self.hash_name = getattr(hash_fn, "__name__", "custom")
            self._digest = hash_fn
        self.block_size = block_size
        self.seed = seed
        self._pack = struct.Struct(f"<{block_size}I").pack
        self._blocks_of = block_bytes(block_size)
        self.root = self._digest(b"kvserve-root:" + str(seed).encode())

    def hash_block(self, parent: bytes, token_ids: list[int], extra: bytes = b"") -> bytes:
        """H(parent, token_ids, extra) for one full block."""
        return self._digest(parent + self._pack(*token_ids) + extra)

    def extend(
        self,
        hashes: list[bytes],
        token_ids: list[int],
        extra: tuple[bytes, bytes],
        packed: bytearray | None = None,
    ) -> None:
        """Append the hashes of blocks that became full since the last call.

        Incremental: each chunk is hashed once, as its last token arrives. The
        new tokens are packed to little-endian uint32 in one call, then sliced;
        `packed`, when given and it ends where `hashes` do, gets those bytes too.
        """
        bs = self.block_size
        n = len(hashes)
        end = len(token_ids) // bs
        if n >= end:
            return
        try:  # pack_tokens, inline; a whole prompt without copying the list first
            if n:
                tokens = array("I", token_ids[n * bs : end * bs])
            else:
                tokens = array("I", token_ids)
                del tokens[end * bs :]
        except OverflowError:
            raise ValueError("token ids must be integers in [0, 2**32)") from None
        if _BIG_ENDIAN:
            tokens.byteswap()
        data = tokens.tobytes()
        if packed is not None and len(packed) == n * 4 * bs:
            packed += data
        digest = self._digest
        parent = hashes[-1] if n else self.root
        first_extra, other_extra = extra
        width = 4 * bs
        offset = 0
        if n == 0:
            parent = digest(parent + data[:width] + first_extra)
            hashes.append(parent)
            offset = width
        append = hashes.append
        new = self._new
        if new is not None and not other_extra:  # the common case: no LoRA
            for (block,) in self._blocks_of(memoryview(data)[offset:]):
                parent = new(parent + block).digest()
                append(parent)
            return
        for at in range(offset, len(data), width):
            parent = digest(parent + data[at : at + width] + other_extra)
            append(parent)


def block_bytes(block_size: int) -> Callable[[bytes | memoryview], Iterator[tuple[Any, ...]]]:
    """Packed tokens -> each block's bytes as a 1-tuple, sliced in C (struct.iter_unpack):
    a Python slice a block cost a tenth of a long prompt's hashing."""
    return struct.Struct(f"{4 * block_size}s").iter_unpack


def pack_tokens(token_ids: list[int]) -> bytes:
    """Token ids as little-endian uint32 bytes: what a block's hash covers, and what a
    cached block keeps to verify a hit (bytes: nothing for the garbage collector to scan)."""
    try:
        packed = array("I", token_ids)
    except OverflowError:
        raise ValueError("token ids must be integers in [0, 2**32)") from None
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def unpack_tokens(data: bytes) -> list[int]:
    """The token ids `pack_tokens` packed."""
    tokens = array("I", data)
    if _BIG_ENDIAN:
        tokens.byteswap()
    return tokens.tolist()


_BIG_ENDIAN = sys.byteorder == "big"
if array("I").itemsize != 4:  # pragma: no cover - every supported platform has 4-byte I
    raise ImportError("kvserve needs a 4-byte array('I')")
