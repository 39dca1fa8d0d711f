"""Token-exactness against transformers: batching, chunking, sharing change speed, not tokens."""

from __future__ import annotations

import pytest

from tests.model.model_driver import NEW, Driver, Request, generate, make_chunk, prompt

BLOCK = 4  # the session runners' block size
# Lengths around block boundaries: 1, k*BLOCK - 1, k*BLOCK, k*BLOCK + 1, longer.
LENGTHS = [1, 3, 4, 5, 8, 11, 16, 23]


@pytest.fixture
def runner(checkpoint, runners):
    return runners[checkpoint.arch]


def test_single_prompts_match_transformers(checkpoint, runner):
    for length in LENGTHS:
        p = prompt(length)
        assert generate(runner, [p], NEW) == [checkpoint.reference(p, NEW)], length


def test_outputs_are_not_degenerate(checkpoint):
    """The oracle only means something if the reference does not repeat one token."""
    assert len(set(checkpoint.reference(prompt(11), NEW))) > 3


def test_batch_of_different_lengths_in_one_step(checkpoint, runner):
    prompts = [prompt(n, salt=1) for n in LENGTHS]
    expected = [checkpoint.reference(p, NEW) for p in prompts]
    assert generate(runner, prompts, NEW) == expected


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 7])
def test_chunked_prefill(checkpoint, runner, chunk_size):
    prompts = [prompt(n, salt=2) for n in (5, 16, 23)]
    expected = [checkpoint.reference(p, NEW) for p in prompts]
    assert generate(runner, prompts, NEW, chunk_size=chunk_size) == expected


def test_mixed_prefill_and_decode_steps(checkpoint, runner):
    prompts = [prompt(n, salt=3) for n in (11, 4, 23, 1, 8)]
    requests = [
        Request(f"m{i}", p, NEW, arrival_step=step)
        for i, (p, step) in enumerate(zip(prompts, (0, 1, 2, 2, 5), strict=True))
    ]
    outputs = Driver(runner, chunk_size=6).run(requests)
    assert outputs == [checkpoint.reference(p, NEW) for p in prompts]


@pytest.mark.parametrize("length", [9, 12, 16])
def test_identical_prompts_share_pending_blocks_in_one_step(checkpoint, runner, length):
    """The second copy hits blocks the first one writes in this very step."""
    p = prompt(length, salt=4)
    requests = [Request("a", p, NEW), Request("b", p, NEW)]
    driver = Driver(runner)
    outputs = driver.run(requests)
    assert requests[1].hit_tokens >= BLOCK * ((length - 1) // BLOCK)
    assert requests[1].hit_tokens > 0
    assert outputs == [checkpoint.reference(p, NEW)] * 2


@pytest.mark.parametrize("length", [8, 12, 13])
def test_cached_prompt_matches_plain_run(checkpoint, runner, length):
    """A prompt seen before; at a block multiple it is fully cached (skip_write_until)."""
    p = prompt(length, salt=5)
    driver = Driver(runner)
    first = driver.run([Request("first", p, NEW)])
    again = Request("again", p, NEW)
    second = driver.run([again])
    assert first == second == [checkpoint.reference(p, NEW)]
    assert again.hit_tokens > 0
    if length % BLOCK == 0:
        assert again.skipped_writes == length
        assert again.hit_tokens == length - 1


def test_fully_cached_prompt_alongside_its_twin_in_same_step(checkpoint, runner):
    """Twin hits a block that is still pending while the original decodes."""
    p = prompt(8, salt=6)
    requests = [Request("x", p, NEW), Request("y", p, NEW, arrival_step=2)]
    outputs = Driver(runner, chunk_size=4).run(requests)
    assert outputs == [checkpoint.reference(p, NEW)] * 2


def test_garbage_in_unwritten_cache_slots_is_never_read(checkpoint, runner):
    """Unused slots are uninitialised memory: fill them with NaN, tokens must not change."""
    for k, v in runner.kv_caches:
        k[1:].fill_(float("nan"))
        v[1:].fill_(float("nan"))
    prompts = [prompt(n, salt=7) for n in (3, 6, 13)]
    assert generate(runner, prompts, NEW) == [checkpoint.reference(p, NEW) for p in prompts]


def test_sample_false_returns_none_and_empty_batch(runner):
    assert runner.execute([]).tokens == []
    chunk = make_chunk("n", [5, 6, 7], 0, [[1]], sample=False)
    assert runner.execute([chunk]).tokens == [None]
