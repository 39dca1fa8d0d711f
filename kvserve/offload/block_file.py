"""One KV block as a file: the disk tier's format, written and checked here.

A block file holds a header and the payload. The header is packed with `struct`,
little-endian (never pickle: loading a pickle runs code):

    magic b"KVSRVBLK" | format version u16 | fingerprint 32 B | key length u16 | key
    | payload length u64 | xxh3_128 digest of the payload (16 B)

The fingerprint identifies model, dtype, KV layout and hash settings: bytes written under
another one are not this engine's KV, whatever their name says, so it is compared in full.
"""

from __future__ import annotations

import os
import struct
from typing import BinaryIO

import xxhash

MAGIC = b"KVSRVBLK"
FORMAT_VERSION = 1
FINGERPRINT_BYTES = 32

_HEAD = struct.Struct("<8sH32sH")  # magic, version, fingerprint, key length; then the key
_TAIL = struct.Struct("<Q16s")  # payload length, payload checksum; then the payload


class BadBlockFile(Exception):
    """A block file that fails a check; the message is the reason."""


def file_size(key_bytes: int, payload_bytes: int) -> int:
    """The size of a block file: header, key and payload."""
    return _HEAD.size + key_bytes + _TAIL.size + payload_bytes


def encode_header(fingerprint: bytes, key: bytes, payload: bytes | memoryview) -> bytes:
    """The header that precedes `payload` in a block file."""
    head = _HEAD.pack(MAGIC, FORMAT_VERSION, fingerprint, len(key))
    return head + key + _TAIL.pack(len(payload), xxhash.xxh3_128_digest(payload))


def read_block(f: BinaryIO, fingerprint: bytes, key: bytes) -> bytes:
    """The payload of an open block file, or BadBlockFile if any check fails."""
    size = os.fstat(f.fileno()).st_size
    head = f.read(_HEAD.size)
    if len(head) < _HEAD.size:
        raise BadBlockFile(f"truncated header ({size} bytes)")
    magic, version, stored_fingerprint, key_len = _HEAD.unpack(head)
    if magic != MAGIC:
        raise BadBlockFile(f"bad magic {magic!r}")
    if version != FORMAT_VERSION:
        raise BadBlockFile(f"format version {version}, expected {FORMAT_VERSION}")
    if stored_fingerprint != fingerprint:
        raise BadBlockFile("written under another fingerprint (model, dtype, layout or hashing)")
    stored_key = f.read(key_len)
    tail = f.read(_TAIL.size)
    if len(stored_key) < key_len or len(tail) < _TAIL.size:
        raise BadBlockFile(f"truncated header ({size} bytes)")
    if stored_key != key:
        raise BadBlockFile(f"holds key {stored_key.hex()}, expected {key.hex()}")
    length, checksum = _TAIL.unpack(tail)
    expected = file_size(key_len, length)
    if size != expected:
        problem = "truncated" if size < expected else "trailing bytes"
        raise BadBlockFile(f"{problem}: {size} bytes, header says {expected}")
    payload = f.read(length)
    if len(payload) != length:
        raise BadBlockFile(f"truncated while reading: {len(payload)} of {length} payload bytes")
    if xxhash.xxh3_128_digest(payload) != checksum:
        raise BadBlockFile("payload checksum mismatch")
    return payload
