"""Paged attention against a dense reference, on scattered block tables."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.model.attention.attention_metadata import DECODE_GROUP, AttentionMetadata
from kvserve.model.attention.plain import paged_attention

BS, KV_HEADS, HEADS, DIM = 4, 2, 4, 8


def dense(q, k, v, start):
    """Causal attention of queries at positions start.. over keys 0..start+len(q)-1."""
    n, ctx = q.shape[0], k.shape[0]
    mask = torch.arange(ctx)[None, :] <= torch.arange(start, start + n)[:, None]
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
    )
    return out.transpose(0, 1).flatten(1)


def test_mixed_batch_with_scattered_and_shared_blocks():
    torch.manual_seed(0)
    caches = [torch.full((16, BS, KV_HEADS, DIM), float("nan")) for _ in range(2)]
    for c in caches:
        c[0].zero_()
    # Three sequences: a fresh prefill that reads block 12 without writing it
    # (skip), a prefill chunk continuing earlier context that writes block 12 in
    # this same step, and a decode. The reader comes first in the batch.
    seqs = [
        dict(start=0, num=3, table=[12], skip=3),
        dict(start=5, num=6, table=[7, 3, 12]),  # positions 5..10; 0..4 already cached
        dict(start=9, num=1, table=[2, 9, 4]),  # decode at position 9
    ]
    full_k = {i: torch.randn(s["start"] + s["num"], KV_HEADS, DIM) for i, s in enumerate(seqs)}
    full_v = {i: torch.randn(s["start"] + s["num"], KV_HEADS, DIM) for i, s in enumerate(seqs)}
    # Block 12 holds positions 8..10 of sequence 1, which are positions 0..2 of sequence 0.
    full_k[0] = full_k[1][8:11].clone()
    full_v[0] = full_v[1][8:11].clone()
    for i, s in enumerate(seqs):  # the context before this step is already in the cache
        for p in range(s["start"]):
            caches[0][s["table"][p // BS], p % BS] = full_k[i][p]
            caches[1][s["table"][p // BS], p % BS] = full_v[i][p]
    q = torch.randn(sum(s["num"] for s in seqs), HEADS, DIM)
    new_k = torch.cat([full_k[i][s["start"] :] for i, s in enumerate(seqs)])
    new_v = torch.cat([full_v[i][s["start"] :] for i, s in enumerate(seqs)])
    spans = [(s["start"], s["num"], s["table"], s.get("skip", 0)) for s in seqs]
    meta = AttentionMetadata.build(spans, BS, torch.device("cpu"))
    out = paged_attention(q, new_k, new_v, caches[0], caches[1], meta, DIM**-0.5)
    offset = 0
    for i, s in enumerate(seqs):
        expected = dense(q[offset : offset + s["num"]], full_k[i], full_v[i], s["start"])
        torch.testing.assert_close(out[offset : offset + s["num"]], expected)
        offset += s["num"]


def test_slot_mapping_and_skip():
    meta = AttentionMetadata.build([(2, 3, [5, 6], 3), (0, 1, [9], 0)], BS, torch.device("cpu"))
    # positions 2 (skipped), 3 -> block 5 offset 3, 4 -> block 6 offset 0; then 9*4+0
    assert meta.write_slots.tolist() == [23, 24, 36]
    assert meta.write_index.tolist() == [1, 2, 3]


def test_bad_block_tables_are_refused():
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="cannot hold 5 tokens"):
        AttentionMetadata.build([(0, 5, [1], 0)], BS, cpu)
    with pytest.raises(ValueError, match="null block"):
        AttentionMetadata.build([(0, 2, [0], 0)], BS, cpu)


def decode_batch(lengths: list[int], tables: list[list[int]]):
    """Caches holding each sequence's context before its last position, and one new
    token per sequence (at position length - 1)."""
    torch.manual_seed(len(lengths))
    caches = [torch.full((32, BS, KV_HEADS, DIM), float("nan")) for _ in range(2)]
    for c in caches:
        c[0].zero_()
    full = [(torch.randn(n, KV_HEADS, DIM), torch.randn(n, KV_HEADS, DIM)) for n in lengths]
    for (k, v), table, n in zip(full, tables, lengths, strict=True):
        for p in range(n - 1):
            caches[0][table[p // BS], p % BS] = k[p]
            caches[1][table[p // BS], p % BS] = v[p]
    q = torch.randn(len(lengths), HEADS, DIM)
    new_k = torch.stack([k[-1] for k, _ in full])
    new_v = torch.stack([v[-1] for _, v in full])
    spans = [(n - 1, 1, table, 0) for n, table in zip(lengths, tables, strict=True)]
    return caches, full, q, new_k, new_v, spans


@pytest.mark.parametrize(
    ("lengths", "tables", "whole"),
    [
        ([6], [[4, 9]], True),  # a lone decoding request
        ([6, 6], [[4, 9], [11, 2]], True),  # equally long: no padding, no mask
        ([3, 9, 5], [[7], [1, 8, 3], [5, 6]], True),  # up to DECODE_GROUP: batch order
        ([3, 5, 9], [[7], [5, 6], [1, 8, 3]], True),
        # more than DECODE_GROUP: sorted by length into groups, rows reordered
        ([2 + (i * 5) % 3 for i in range(17)], [[i + 1] for i in range(17)], False),
    ],
)
def test_decode_batches_with_and_without_the_whole_batch_path(lengths, tables, whole):
    caches, full, q, new_k, new_v, spans = decode_batch(lengths, tables)
    meta = AttentionMetadata.build(spans, BS, torch.device("cpu"))
    assert (meta.whole_batch is not None) == whole
    if len(lengths) <= DECODE_GROUP:
        assert len(meta.decodes) == 1
        assert (meta.decodes[0].mask is not None) == (len(set(lengths)) > 1)
    else:
        assert [len(group.index) for group in meta.decodes] == [DECODE_GROUP, 1]
    out = paged_attention(q, new_k, new_v, caches[0], caches[1], meta, DIM**-0.5)
    for i, (k, v) in enumerate(full):
        expected = dense(q[i : i + 1], k, v, lengths[i] - 1)
        torch.testing.assert_close(out[i : i + 1], expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fresh_prefill_runs_causal_and_gives_the_masks_bits(dtype):
    cpu = torch.device("cpu")
    spans = [(0, 37, list(range(1, 11)), 0), (4, 6, [11, 12, 13], 0), (0, 5, [14, 15], 3)]
    meta = AttentionMetadata.build(spans, BS, cpu)
    assert [s.causal for s in meta.prefills] == [True, False, False]  # fresh, chunk, skip
    windowed = AttentionMetadata.build(spans[:1], BS, cpu, window=8)
    assert not windowed.prefills[0].causal
    torch.manual_seed(0)
    caches = [torch.zeros(16, BS, KV_HEADS, DIM, dtype=dtype) for _ in range(2)]
    q, k, v = (torch.randn(37, h, DIM, dtype=dtype) for h in (HEADS, KV_HEADS, KV_HEADS))
    fresh = AttentionMetadata.build(spans[:1], BS, cpu)
    causal = paged_attention(q, k, v, *caches, fresh, DIM**-0.5)
    fresh.prefills[0].causal = False  # the same span through its explicit mask
    masked = paged_attention(q, k, v, *caches, fresh, DIM**-0.5)
    assert torch.equal(causal, masked)
    expected = dense(q.float(), k.float(), v.float(), 0)
    tolerance = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(causal.float(), expected, **tolerance)
