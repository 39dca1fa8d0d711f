"""The model-free runner's K/V (token ids per slot): what the offload connector moves."""

from __future__ import annotations

import struct

import pytest

from kvserve.batch import SeqChunk
from kvserve.engine.model_free_kv import ModelFreeKV
from kvserve.kvcache.plan import CopyOp, StepPlan
from kvserve.kvcache.specs import FullAttentionSpec, MambaStateSpec

BS = 4


def chunk(rid, tokens, tables, start, end, copies=()):
    plan = StepPlan(rid, tables, start, end - start, copies=copies)
    return SeqChunk(rid, tokens, plan)


def test_payloads_carry_the_token_ids_at_the_stated_size():
    kv = ModelFreeKV([FullAttentionSpec(block_size=BS)], bytes_per_token=16)
    tokens = [7, 8, 9, 10, 11]
    kv.run(chunk("a", tokens, ((1, 2),), 0, 5))
    data = kv.read(0, 1, 0, BS)
    assert len(data) == 16 * BS
    assert struct.unpack_from("<4I", data) == (7, 8, 9, 10)
    assert data[16:] == bytes(16 * BS - 16)
    kv.write(0, 3, data, 0, BS)  # as a tier load puts it into another block
    assert kv.read(0, 3, 0, BS) == data
    with pytest.raises(ValueError, match="payload of 15 bytes for 1 tokens of 16 bytes"):
        kv.write(0, 3, data[:15], 0, 1)


def test_a_hit_or_a_load_must_hold_the_requests_prefix():
    kv = ModelFreeKV([FullAttentionSpec(block_size=BS)], bytes_per_token=4)
    kv.run(chunk("a", [1, 2, 3, 4, 5, 6], ((1, 2),), 0, 6))
    # "b" shares block 1 (tokens 1..4): its first chunk starts after the hit.
    kv.run(chunk("b", [1, 2, 3, 4, 9, 9], ((1, 3),), 4, 6))
    assert kv.checked_positions == 4
    # A block loaded with other tokens is caught the first time a request reads it.
    kv.write(0, 4, struct.pack("<4I", 1, 2, 99, 4), 0, BS)
    with pytest.raises(AssertionError, match="block 4 holds token 99 at position 2"):
        kv.run(chunk("c", [1, 2, 3, 4, 5], ((4, 5),), 4, 5))


def test_copy_on_write_and_a_continuing_chunk():
    kv = ModelFreeKV([FullAttentionSpec(block_size=BS)], bytes_per_token=4)
    kv.run(chunk("a", [1, 2, 3, 4, 5, 6], ((1, 2),), 0, 6))
    # "b" hits 5 tokens: 4 in block 1, and 1 copied out of block 2 into its own block 3.
    copy = CopyOp(group=0, src_block=2, src_offset=0, dst_block=3, dst_offset=0, num_tokens=1)
    kv.run(chunk("b", [1, 2, 3, 4, 5, 7], ((1, 3),), 5, 6, copies=(copy,)))
    assert kv.read(0, 3, 0, 2) == struct.pack("<2I", 5, 7)
    checked = kv.checked_positions
    kv.run(chunk("b", [1, 2, 3, 4, 5, 7, 8], ((1, 3),), 6, 7))  # decode: nothing to check
    assert kv.checked_positions == checked


def test_state_pages_have_a_size_and_no_content():
    specs = [FullAttentionSpec(block_size=BS), MambaStateSpec(block_size=BS)]
    kv = ModelFreeKV(specs, bytes_per_token=8)
    assert kv.read(1, 5) == bytes(8 * BS)
    kv.write(1, 5, bytes(8 * BS))
    with pytest.raises(ValueError):
        kv.write(1, 5, bytes(8))


def test_a_token_id_needs_four_bytes():
    with pytest.raises(ValueError, match="must be >= 4"):
        ModelFreeKV([FullAttentionSpec(block_size=BS)], bytes_per_token=3)
