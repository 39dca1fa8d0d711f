"""Block hashes: a fixed, seeded format that every process and machine agrees on."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys

import pytest
import xxhash
from _cache_seqs import add_seq
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.kvcache import (
    BlockHasher,
    CacheSequence,
    KVCacheConfig,
    KVCacheManager,
    extra_key_bytes,
)

TOKENS = [7, 0, 2**32 - 1, 15, 3, 3, 3, 9, 100_000, 42, 1, 2, 5]  # 3 full blocks of 4 + 1


def hashes_of(block_size, tokens, hash_fn="sha256", seed=0, lora=None, salt=None):
    out: list[bytes] = []
    BlockHasher(block_size, hash_fn, seed).extend(out, tokens, extra_key_bytes(lora, salt))
    return out


def reference_sha256(block_size, tokens, seed=0, first_extra=b"", other_extra=b""):
    """The documented format, written out with hashlib: H(parent + uint32 LE ids + extra)."""
    parent = hashlib.sha256(b"kvserve-root:" + str(seed).encode()).digest()
    out = []
    for i in range(len(tokens) // block_size):
        chunk = tokens[i * block_size : (i + 1) * block_size]
        data = parent + struct.pack(f"<{block_size}I", *chunk)
        parent = hashlib.sha256(data + (other_extra if i else first_extra)).digest()
        out.append(parent)
    return out


def test_sha256_matches_the_documented_format():
    got = hashes_of(4, TOKENS, seed=0)
    assert len(got) == 3  # the partial tail block has no hash
    assert got == reference_sha256(4, TOKENS, seed=0)
    assert all(len(h) == 32 for h in got)


def test_salt_enters_only_the_first_block_and_lora_every_block():
    salt = b"S" + struct.pack("<I", 6) + b"tenant"
    lora = b"L" + struct.pack("<I", 2) + b"ad"
    assert extra_key_bytes(None, "tenant") == (salt, b"")
    assert extra_key_bytes("ad", "tenant") == (salt + lora, lora)
    assert hashes_of(4, TOKENS, salt="tenant") == reference_sha256(4, TOKENS, first_extra=salt)
    assert hashes_of(4, TOKENS, lora="ad", salt="tenant") == reference_sha256(
        4, TOKENS, first_extra=salt + lora, other_extra=lora
    )
    plain, salted = hashes_of(4, TOKENS), hashes_of(4, TOKENS, salt="tenant")
    assert all(a != b for a, b in zip(plain, salted, strict=True))  # diverged from the root


def test_extra_keys_are_unambiguous():
    variants = [(None, None), ("a", None), (None, "a"), ("a", "a"), ("ab", None), ("", None)]
    firsts = {extra_key_bytes(lora, salt)[0] for lora, salt in variants}
    assert len(firsts) == len(variants)
    assert len({tuple(hashes_of(4, TOKENS, lora=lo, salt=sa)) for lo, sa in variants}) == 6


_CHILD = """
import json, sys
from kvserve.kvcache import BlockHasher, extra_key_bytes
tokens, seed = json.loads(sys.argv[1]), int(sys.argv[2])
out = {}
for name in ("sha256", "xxh3_128"):
    for lora, salt in ((None, None), ("ad", "tenant")):
        hashes = []
        BlockHasher(4, name, seed).extend(hashes, tokens, extra_key_bytes(lora, salt))
        out[f"{name}/{lora}/{salt}"] = [h.hex() for h in hashes]
print(json.dumps(out))
"""


def _hashes_in_subprocess(seed: int, python_hash_seed: str) -> dict:
    env = dict(os.environ, PYTHONHASHSEED=python_hash_seed)
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(TOKENS), str(seed)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(proc.stdout)


def test_hashes_are_identical_across_processes():
    here = {
        f"{name}/{lora}/{salt}": [h.hex() for h in hashes_of(4, TOKENS, name, 11, lora, salt)]
        for name in ("sha256", "xxh3_128")
        for lora, salt in ((None, None), ("ad", "tenant"))
    }
    first = _hashes_in_subprocess(11, "1")
    second = _hashes_in_subprocess(11, "2")  # Python's own str hash differs; ours must not
    assert first == second == here
    assert first["sha256/None/None"] == [h.hex() for h in reference_sha256(4, TOKENS, seed=11)]


@pytest.mark.parametrize("hash_fn", ["sha256", "xxh3_128"])
def test_different_seeds_differ(hash_fn):
    a, b = hashes_of(4, TOKENS, hash_fn, seed=0), hashes_of(4, TOKENS, hash_fn, seed=1)
    assert len(a) == len(b) == 3
    assert all(x != y for x, y in zip(a, b, strict=True))
    assert BlockHasher(4, hash_fn, 0).root != BlockHasher(4, hash_fn, 1).root


def test_xxh3_128_format_and_manager_hit():
    got = hashes_of(4, TOKENS, "xxh3_128", seed=3)
    parent = xxhash.xxh3_128_digest(b"kvserve-root:3")
    for i, h in enumerate(got):
        parent = xxhash.xxh3_128_digest(parent + struct.pack("<4I", *TOKENS[4 * i : 4 * i + 4]))
        assert h == parent and len(h) == 16
    m = KVCacheManager(KVCacheConfig(num_blocks=10, block_size=4, hash_fn="xxh3_128"))
    a = CacheSequence("a", list(TOKENS))
    a = add_seq(m, a)
    assert m.allocate_slots(a.request_id, len(TOKENS), 0)
    m.end_step()
    b = CacheSequence("b", list(TOKENS))
    b = add_seq(m, b)
    assert b.block_hashes == hashes_of(4, TOKENS, "xxh3_128", 0) != got
    hit = m.get_computed_blocks(b.request_id, 0)
    assert hit.num_tokens == 12
    assert [x.block_id for x in hit.blocks[0]] == m.block_ids(a.request_id)[0][:3]


def test_unknown_hash_name_and_bad_block_size():
    with pytest.raises(ValueError, match="unknown hash function"):
        BlockHasher(4, "md5")
    with pytest.raises(ValueError):
        BlockHasher(0)


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=40),
    block_size=st.sampled_from([1, 3, 4, 16]),
    cuts=st.lists(st.integers(0, 40), max_size=6),
    lora=st.sampled_from([None, "ad"]),
    salt=st.sampled_from([None, "t"]),
)
def test_incremental_extend_equals_hashing_at_once(tokens, block_size, cuts, lora, salt):
    extra = extra_key_bytes(lora, salt)
    hasher = BlockHasher(block_size, "sha256", 5)
    at_once: list[bytes] = []
    hasher.extend(at_once, tokens, extra)
    incremental: list[bytes] = []
    for cut in [*sorted(cuts), len(tokens)]:
        hasher.extend(incremental, tokens[: min(cut, len(tokens))], extra)
        assert len(incremental) == max(len(incremental), min(cut, len(tokens)) // block_size)
    assert incremental == at_once
    assert len(at_once) == len(tokens) // block_size
    first_extra, other_extra = extra
    assert at_once == reference_sha256(block_size, tokens, 5, first_extra, other_extra)
    one_by_one: list[bytes] = []
    for n in range(len(tokens) + 1):
        hasher.extend(one_by_one, tokens[:n], extra)
        assert len(one_by_one) == n // block_size
    assert one_by_one == at_once


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("bad", [-1, 2**32, 2**40])
@pytest.mark.parametrize("position", ["full block", "partial tail", "short prompt"])
def test_token_ids_outside_uint32_are_a_value_error(bad, position, caching):
    """Caught at admission wherever the bad id sits (not later, inside allocate_slots)."""
    m = KVCacheManager(KVCacheConfig(num_blocks=8, block_size=4, enable_prefix_caching=caching))
    prompt = {
        "full block": [1, 2, bad, 3, 4, 5],
        "partial tail": [1, 2, 3, 4, 5, bad],
        "short prompt": [bad],
    }[position]
    with pytest.raises(ValueError, match="req-bad"):
        add_seq(m, CacheSequence("req-bad", prompt))
    assert m.pool.num_used == 0
    ok = CacheSequence("ok", [0, 2**32 - 1, 5])
    add_seq(m, ok)  # the boundary values themselves are fine
    assert m.allocate_slots(ok.request_id, 3, 0)
