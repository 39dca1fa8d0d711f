"""Identical prompts in one step, exhaustively: every length, 2 to 5 copies, every backend.

The project's first seed is identical prompts scheduled together: the cache
shares their blocks (computed once, stored once), and every copy must decode
exactly what transformers decodes for one. Lengths run from 1 through four
full blocks and one token more, so every position of the last token in its
block and every fully cached prompt (a block multiple, its last token
recomputed with its write skipped) is met; a block-aligned batch of copies
once crashed the plain backend's decode path (issue 25). Each length runs
cold, then again with its prompt cached, in batches that hold groups of 2, 3,
4 and 5 copies beside unshared prompts, all copies of one prompt alone, and
one prompt with `n` > 1 completions; for Llama, Qwen3, Gemma 3 (sliding
windows, soft-caps) and Bamba (Mamba2 state), through the plain and flex
backends, and a sample through the triton kernels in Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams

BS = 4
LENGTHS = range(1, 4 * BS + 2)
COPIES = range(2, 6)
NEW = 3
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
ARCHS = ["llama", "qwen3", "gemma3", "bamba"]


def prompt(length: int, salt: int) -> list[int]:
    gen = torch.Generator().manual_seed(50_000 + 1_000 * salt + length)
    return torch.randint(3, 300, (length,), generator=gen).tolist()


def checkpoint_of(request: pytest.FixtureRequest, arch: str):
    if arch in ("gemma3", "bamba"):
        return request.getfixturevalue(f"{arch}_checkpoint")
    return request.getfixturevalue("checkpoints")[arch]


def make(ck, backend: str) -> LLM:
    return LLM(ck.path, block_size=BS, num_kv_blocks=400, dtype="float32", device="cpu",
               num_threads=1, attention_backend=backend)  # fmt: skip


def tokens(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


def copies_batch(length: int, salt: int) -> list[list[int]]:
    """Groups of 2, 3, 4 and 5 copies of four prompts of `length`, interleaved, beside two
    unshared prompts (one as long, one a block longer): decode steps mix shared rows of
    several groups with unshared ones."""
    groups = [prompt(length, salt + c) for c in COPIES]
    batch = [p for c, p in zip(COPIES, groups, strict=True) for _ in range(c)]
    batch = batch[0::2] + batch[1::2]  # copies of a prompt are not neighbours
    return [prompt(length, salt + 10), *batch, prompt(length + BS, salt + 11)]


def check_lengths(llm: LLM, ck, lengths: range | list[int], salt: int = 0) -> None:
    """Every length: the mixed batch cold then cached, copies alone, and `n` > 1."""
    for length in lengths:
        batch = copies_batch(length, salt + 100 * length)
        expected = [ck.reference(p, NEW) for p in batch]
        cold = llm.generate(batch, GREEDY, use_tqdm=False)
        assert tokens(cold) == expected, ("cold", length)
        cached = llm.generate(batch, GREEDY, use_tqdm=False)
        assert tokens(cached) == expected, ("cached", length)
        if length > BS:  # a full block is there to hit
            assert all(o.num_cached_tokens > 0 for o in cached), length
        copies = 2 + length % 4
        alone = prompt(length, salt + 100 * length + 50)
        expected_alone = [ck.reference(alone, NEW)] * copies
        assert tokens(llm.generate([alone] * copies, GREEDY, use_tqdm=False)) == expected_alone
        several = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, n=copies)
        assert tokens(llm.generate([alone], several, use_tqdm=False)) == expected_alone
    stats = llm.stats()
    assert stats["duplicate_blocks_peak"] == 0
    assert llm.engine.manager.pool.num_used == 0


@pytest.mark.parametrize("backend", ["plain", pytest.param("flex", marks=pytest.mark.slow)])
@pytest.mark.parametrize("arch", ARCHS)
def test_identical_prompts_of_every_length_equal_transformers(request, arch, backend):
    ck = checkpoint_of(request, arch)
    check_lengths(make(ck, backend), ck, LENGTHS)


@pytest.mark.slow  # Triton's interpreter
@pytest.mark.parametrize(("arch", "lengths"), [("llama", [2 * BS, 4 * BS]), ("gemma3", [4 * BS])])
def test_identical_block_aligned_prompts_through_triton_kernels(request, arch, lengths):
    """A sample (Triton's interpreter is slow): block-aligned copies, cold and cached."""
    pytest.importorskip("triton")
    ck = checkpoint_of(request, arch)
    check_lengths(make(ck, "triton"), ck, lengths, salt=7)
