"""The FlexAttention backend against the plain path, and end to end against transformers.

One step mixes fresh prefills, chunked prefills (earlier context in the cache), a fully
cached twin that reads blocks another sequence writes in this very step, and decodes
sharing prompt blocks, all over shuffled physical blocks. Both paths start from the
same cache and must write the same slots and return the same outputs.

Every compiled shape costs seconds on the CPU: the unit tests share one head layout
(4 query heads over 2 kv heads of 16, as the tiny Gemma 3) and few token buckets.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
import transformers

from kvserve import LLM, SamplingParams
from kvserve.engine.engine_args import ATTENTION_BACKENDS, EngineArgs
from kvserve.model import ModelRunner
from kvserve.model.attention import paged_attention
from kvserve.model.attention_metadata import AttentionMetadata
from kvserve.model.flex_metadata import BLOCK, Q_TILE, FlexMetadata, bucket
from kvserve.model.step_metadata import METADATA_BUILDERS

BS, KV_HEADS, HEADS, DIM = 4, 2, 4, 16
NUM_BLOCKS = 160
CPU = torch.device("cpu")


def random_step(seed: int, prefill: int, chunk: tuple[int, int], decodes: list[int]):
    """Spans (start, num, table, skip) of one step over shuffled blocks: a fresh prefill of
    `prefill` tokens, its fully cached twin (reads what the prefill writes, writes
    nothing), a chunk (start, num) after cached context, and decodes at the given
    context lengths whose tables share their first 4 blocks (a shared prompt)."""
    rng = random.Random(seed)
    free = list(range(1, NUM_BLOCKS))
    rng.shuffle(free)

    def blocks(n: int) -> list[int]:
        return [free.pop() for _ in range(-(-n // BS))]

    shared = blocks(4 * BS)
    spans = []
    first = blocks(prefill)
    spans.append((0, prefill, first, 0))
    start, num = chunk
    spans.append((start, num, blocks(start + num), 0))
    for length in decodes:
        spans.append((length - 1, 1, shared + blocks(length - 4 * BS), 0))
    spans.append((0, prefill, first, prefill))
    rng.shuffle(spans)
    return spans


def both_paths(spans, window=None, softcap=None, seed=0):
    """(outputs, caches after the step) of the plain and the flex path."""
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(NUM_BLOCKS, BS, KV_HEADS, DIM, generator=gen)
    v_cache = torch.randn(NUM_BLOCKS, BS, KV_HEADS, DIM, generator=gen)
    k_cache[0] = v_cache[0] = 0  # the null block
    tokens = sum(num for _, num, _, _ in spans)
    q = torch.randn(tokens, HEADS, DIM, generator=gen)
    k = torch.randn(tokens, KV_HEADS, DIM, generator=gen)
    v = torch.randn(tokens, KV_HEADS, DIM, generator=gen)
    results = []
    for build in (AttentionMetadata.build, FlexMetadata.build):
        caches = k_cache.clone(), v_cache.clone()
        meta = build(spans, BS, CPU, window)
        with torch.inference_mode():  # as the runner calls it (one compiled variant)
            out = paged_attention(q, k, v, *caches, meta, DIM**-0.5, softcap)
        results.append((out, caches))
    return results


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
    with pytest.raises(ValueError, match="attention_backend must be one of plain, flex, got 'x'"):
        EngineArgs(attention_backend="x")
    with pytest.raises(ValueError, match="attention_backend must be one of plain, flex"):
        ModelRunner("/no/such/model", block_size=BS, attention_backend="flash")  # before loading


GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def prompts() -> list[list[int]]:
    """A shared 13-token prefix (hits in the second round), and lengths around blocks."""
    gen = torch.Generator().manual_seed(17)
    shared = torch.randint(3, 300, (13,), generator=gen).tolist()
    rest = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (3, 6, 8, 1)]
    return [shared + rest[0], shared + rest[1], rest[2], rest[3]]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """A tiny Llama with the unit tests' head layout: every test meets the same kernels."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=320, max_position_embeddings=512,
        attention_bias=True, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        initializer_range=0.2,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("llama-flex")
    model.save_pretrained(path)
    return Reference(str(path), model)


@dataclass
class Reference:
    """A saved checkpoint and its transformers model, the oracle (as conftest's)."""

    path: str
    hf_model: transformers.PreTrainedModel

    def reference(self, prompt: list[int], new: int) -> list[int]:
        with torch.no_grad():
            out = self.hf_model.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=new, pad_token_id=0
            )
        return out[0, len(prompt) :].tolist()


def two_rounds(ck, **options) -> None:
    """Greedy tokens equal transformers' in both rounds; the second one hits the cache."""
    llm = LLM(ck.path, block_size=BS, num_kv_blocks=96, dtype="float32", device="cpu",
              num_threads=1, attention_backend="flex", **options)  # fmt: skip
    assert llm.engine.runner.attention_backend == "flex"
    expected = [ck.reference(p, GREEDY.max_tokens) for p in prompts()]
    for _ in range(2):
        outputs = llm.generate(prompts(), GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.stats()["prefix_hit_tokens"] > 0


@pytest.mark.parametrize("budget", [8192, 7])  # whole prompts; chunks mixed with decodes
def test_llama_greedy_equals_transformers(llama, budget):
    two_rounds(llama, max_num_batched_tokens=budget)


def test_gemma3_sliding_windows_equal_transformers(gemma3_checkpoint):
    two_rounds(gemma3_checkpoint, max_num_batched_tokens=7)


def test_bamba_attention_layer_equals_transformers(bamba_checkpoint):
    """Mamba2 layers keep their own path; the attention layer reads through flex."""
    two_rounds(bamba_checkpoint, max_num_batched_tokens=7)
