"""The FlexAttention backend against the plain path, and end to end against transformers.

One step mixes fresh prefills, chunked prefills (earlier context in the cache), a fully
cached twin that reads blocks another sequence writes in this very step, and decodes
sharing prompt blocks, all over shuffled physical blocks. Both paths start from the
same cache and must write the same slots and return the same outputs.

Every compiled shape costs seconds on the CPU: the unit tests share one head layout
(4 query heads over 2 kv heads of 16, as the tiny Gemma 3) and few token buckets.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.engine.engine_args import ATTENTION_BACKENDS, EngineArgs
from kvserve.model import ModelRunner
from kvserve.model.attention.attention_metadata import AttentionMetadata
from kvserve.model.attention.flex_metadata import BLOCK, Q_TILE, FlexMetadata, bucket
from kvserve.model.attention.step_metadata import METADATA_BUILDERS
from tests.model.attention.attention_steps import BS, random_step, run_paths
from tests.model.attention.backend_oracle import two_rounds

CPU = torch.device("cpu")


def both_paths(spans, window=None, softcap=None, seed=0):
    return run_paths((AttentionMetadata.build, FlexMetadata.build), spans, window, softcap, seed)


@pytest.mark.slow  # the module's first compile: a minute on 2 cold cores
@pytest.mark.parametrize(
    ("window", "softcap"), [(None, None), (5, None), (None, 3.0), (3, 30.0)]
)  # fmt: skip
def test_mixed_step_equals_the_plain_path(window, softcap):
    spans = random_step(window or 0, prefill=9, chunk=(10, 7), decodes=[17, 20, 23, 5])
    (plain, plain_caches), (flex, flex_caches) = both_paths(spans, window, softcap)
    torch.testing.assert_close(flex, plain, rtol=1e-5, atol=1e-5)
    for a, b in zip(flex_caches, plain_caches, strict=True):
        assert torch.equal(a, b)  # the same slots written, with the same values


@pytest.mark.parametrize("window", [None, 6])
def test_chunk_and_tile_boundaries(window):
    """Over 128 queries and keys: sequences cross the 128-row query tile and 128-key
    tiles; chunks start and end mid-block and on block boundaries."""
    spans = random_step(7, prefill=70, chunk=(32, 21), decodes=[16, 17, 20])
    assert bucket(sum(n for _, n, _, _ in spans)) == 256  # the keys' bucket too, unwindowed
    (plain, _), (flex, _) = both_paths(spans, window, seed=1)
    torch.testing.assert_close(flex, plain, rtol=1e-5, atol=1e-5)


def test_the_block_mask_visits_every_needed_tile_and_skips_others():
    """Each query tile visits the key tiles from its first sequence's first key to its last
    sequence's last key: every tile where mask_mod allows a pair, not the whole grid."""
    spans = random_step(7, prefill=70, chunk=(32, 21), decodes=[16, 17, 20])
    meta = FlexMetadata.build(spans, BS, CPU)
    mask = meta.block_mask
    q_len, kv_len = mask.seq_lengths
    allowed = mask.mask_mod(0, 0, torch.arange(q_len)[:, None], torch.arange(kv_len)[None, :])
    needed = allowed.view(q_len // Q_TILE, Q_TILE, kv_len // BLOCK, BLOCK).any(3).any(1)
    visited = torch.zeros_like(needed)
    for tile, count in enumerate(mask.kv_num_blocks[0, 0].tolist()):
        visited[tile, mask.kv_indices[0, 0, tile, :count].long()] = True
    assert not (needed & ~visited).any()
    assert 0 < int(visited.sum()) < visited.numel()


def test_decodes_only_and_buckets():
    spans = random_step(3, prefill=2, chunk=(40, 2), decodes=[17, 18, 19, 30, 33])
    spans = [s for s in spans if s[1] == 1]
    (plain, _), (flex, _) = both_paths(spans, seed=2)
    torch.testing.assert_close(flex, plain, rtol=1e-5, atol=1e-5)
    assert [bucket(n) for n in (1, 128, 129, 300)] == [128, 128, 256, 512]


def test_a_write_into_the_null_block_is_refused():
    with pytest.raises(ValueError, match="position 4 would be written into the null block"):
        FlexMetadata.build([(2, 3, [5, 0], 0)], BS, CPU)
    with pytest.raises(ValueError, match="cannot hold 5 tokens"):
        FlexMetadata.build([(0, 5, [1], 0)], BS, CPU)


def test_the_option_names_the_backends():
    assert set(ATTENTION_BACKENDS) == set(METADATA_BUILDERS)
    assert EngineArgs().attention_backend == "plain"
    names = "plain, flex, triton"
    with pytest.raises(ValueError, match=f"attention_backend must be one of {names}, got 'x'"):
        EngineArgs(attention_backend="x")
    with pytest.raises(ValueError, match=f"attention_backend must be one of {names}"):
        ModelRunner("/no/such/model", block_size=BS, attention_backend="flash")  # before loading


@pytest.mark.parametrize("budget", [8192, 7])  # whole prompts; chunks mixed with decodes
def test_llama_greedy_equals_transformers(llama, budget):
    two_rounds(llama, backend="flex", max_num_batched_tokens=budget)


def test_gemma3_sliding_windows_equal_transformers(gemma3_checkpoint):
    two_rounds(gemma3_checkpoint, backend="flex", max_num_batched_tokens=7)


def test_bamba_attention_layer_equals_transformers(bamba_checkpoint):
    """Mamba2 layers keep their own path; the attention layer reads through flex."""
    two_rounds(bamba_checkpoint, backend="flex", max_num_batched_tokens=7)
