"""The Triton backend against the plain path, and end to end against transformers.

Without CUDA the kernels run in Triton's interpreter: the same kernel code a GPU
compiles, executed with numpy (tl.dot's shape rules and masks included), so these
checks hold the kernels' indexing, masking and online softmax; speed is a GPU's matter.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.model import ModelRunner
from kvserve.model.attention.attention_metadata import AttentionMetadata
from kvserve.model.attention.paged_metadata import NOT_WRITTEN, PagedMetadata
from kvserve.model.attention.plain import paged_attention
from tests.model.attention.attention_steps import CPU, random_step, run_paths
from tests.model.attention.backend_oracle import two_rounds

pytest.importorskip("triton")

from kvserve.model.attention.triton_attention import (
    MAX_SPLITS,
    decode_splits,
    triton_paged_attention,
)


def both_paths(spans, window=None, softcap=None, seed=0, **shape):
    return run_paths((AttentionMetadata.build, PagedMetadata.build), spans, window, softcap,
                     seed, **shape)  # fmt: skip


def assert_same(results) -> None:
    (plain, plain_caches), (triton, triton_caches) = results
    torch.testing.assert_close(triton, plain, rtol=1e-5, atol=1e-5)
    for a, b in zip(triton_caches, plain_caches, strict=True):
        assert torch.equal(a, b)  # the same slots written, with the same values


@pytest.mark.parametrize(
    ("window", "softcap"), [(None, None), (5, None), (None, 3.0), (3, 30.0)]
)  # fmt: skip
def test_mixed_step_equals_the_plain_path(window, softcap):
    """Fresh prefill, its cached twin reading what it writes in this step, a chunk over
    cached context and decodes sharing prompt blocks, on shuffled blocks."""
    spans = random_step(window or 0, prefill=9, chunk=(10, 7), decodes=[17, 20, 23, 5])
    assert_same(both_paths(spans, window, softcap))


@pytest.mark.parametrize("window", [None, 6])
def test_query_tiles_and_key_tiles_cross_blocks(window):
    """A 70-token prefill spans three query tiles of 32 tokens; a chunk starts mid-block
    after 90 cached tokens; keys run over several 64-key tiles."""
    spans = random_step(7, prefill=70, chunk=(90, 21), decodes=[16, 17, 20, 130])
    assert_same(both_paths(spans, window, seed=1))


def test_uneven_heads_dims_and_blocks():
    """3 query heads per kv head (rows padded to 4), head_dim 24 (padded to 32) and
    blocks of 6 tokens (a Mamba hybrid's inflated block is no power of two)."""
    spans = random_step(5, prefill=13, chunk=(7, 9), decodes=[25, 26, 31], block_size=6)
    assert_same(both_paths(spans, 4, 20.0, seed=2, block_size=6, heads=6, kv_heads=2, dim=24))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_rounding_of_the_plain_path(dtype):
    """The half-precision kernels (on a GPU: tensor-core products, float32 softmax)."""
    spans = random_step(9, prefill=20, chunk=(10, 7), decodes=[17, 40])
    (plain, plain_caches), (triton, triton_caches) = both_paths(spans, 5, 30.0, dtype=dtype)
    assert triton.dtype == dtype
    torch.testing.assert_close(triton.float(), plain.float(), rtol=0, atol=3e-2)
    for a, b in zip(triton_caches, plain_caches, strict=True):
        assert torch.equal(a, b)


def test_decodes_only_and_no_written_tokens():
    spans = random_step(3, prefill=2, chunk=(40, 2), decodes=[17, 18, 19, 30, 33])
    decodes = [s for s in spans if s[1] == 1]
    assert_same(both_paths(decodes, seed=3))
    cached = [(0, n, table, n) for start, n, table, _ in spans if start == 0]
    assert_same(both_paths(cached, seed=4))  # every token's K/V cached: nothing written


def test_metadata_packs_slots_tables_and_starts():
    meta = PagedMetadata.build([(5, 3, [7, 9, 4], 6), (0, 1, [2], 0)], 4, CPU)
    assert meta.slots.tolist() == [NOT_WRITTEN, 9 * 4 + 2, 9 * 4 + 3, 2 * 4]
    assert meta.query_start.tolist() == [0, 3, 4]
    assert meta.seq_starts.tolist() == [5, 0]
    assert meta.block_tables.tolist() == [[7, 9], [2, 0]]
    assert (meta.num_seqs, meta.max_query_len) == (2, 3)


def test_a_write_into_the_null_block_is_refused():
    with pytest.raises(ValueError, match="position 4 would be written into the null block"):
        PagedMetadata.build([(2, 3, [5, 0], 0)], 4, CPU)
    with pytest.raises(ValueError, match="cannot hold 5 tokens"):
        PagedMetadata.build([(0, 5, [1], 0)], 4, CPU)


def test_llama_greedy_equals_transformers(llama):
    """Prefills chunked and mixed with decodes, prefix hits in the second round (Gemma 3's
    windows end to end: tests/model/attention/test_decode_graphs.py)."""
    two_rounds(llama, backend="triton", max_num_batched_tokens=7)


def test_bamba_attention_layer_equals_transformers(bamba_checkpoint):
    """Mamba2 layers keep their own path; the attention layer reads blocks inflated to
    hold a state page."""
    two_rounds(bamba_checkpoint, backend="triton", max_num_batched_tokens=7)


def test_the_cpu_refuses_the_backend_outside_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="'triton' runs on CUDA, not on cpu"):
        ModelRunner("/no/such/model", block_size=4, device="cpu", attention_backend="triton")


@pytest.mark.parametrize(("window", "softcap", "dtype"), [
    (None, None, torch.float32), (5, 30.0, torch.float32), (None, None, torch.bfloat16),
])  # fmt: skip
@pytest.mark.parametrize("splits", [2, 4, 16])
def test_split_contexts_merge_to_the_plain_path(splits, window, softcap, dtype):
    """Decodes with each context cut into `splits` ranges of whole key tiles: ranges past a
    short context (or before a window) see no key and must weigh nothing in the merge."""
    spans = [s for s in random_step(11, 2, (40, 2), [5, 17, 33, 70, 130]) if s[1] == 1]
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache = (torch.randn(160, 4, 2, 16, generator=gen).to(dtype) for _ in range(2))
    k_cache[0] = v_cache[0] = 0
    q, k, v = (torch.randn(len(spans), h, 16, generator=gen).to(dtype) for h in (4, 2, 2))
    outs = []
    for build in (AttentionMetadata.build, PagedMetadata.build):
        meta = build(spans, 4, CPU, window)
        caches = k_cache.clone(), v_cache.clone()
        if isinstance(meta, PagedMetadata):
            out = triton_paged_attention(q, k, v, *caches, meta, 0.25, softcap, splits=splits)
        else:
            out = paged_attention(q, k, v, *caches, meta, 0.25, softcap)
        outs.append(out.float())
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(outs[1], outs[0], rtol=tolerance, atol=tolerance)


def test_decode_splits_fill_the_multiprocessors_only_on_cuda():
    assert decode_splits(4, CPU) == 1
    if torch.cuda.is_available():
        gpu = torch.device("cuda")
        assert decode_splits(1, gpu) == MAX_SPLITS  # one sequence, one kv head
        assert decode_splits(256 * 8, gpu) == 1  # a full batch fills the GPU by itself
