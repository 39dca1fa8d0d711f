"""The runner on the test device (CUDA; tests/_device.py): test_oracle's tests, unchanged.

The test functions are test_oracle's own, collected here a second time with
a `runner` fixture that puts each tiny float32 checkpoint on the test
device; transformers' reference still runs on the CPU. Batching, chunked
prefill, pending-block sharing, prefix hits and never-read cache slots (NaN
in the device's unwritten memory) must give the CPU's tokens.
`KVSERVE_TEST_DEVICE=cpu` runs this file on the CPU.
"""

from __future__ import annotations

import pytest
from _device import DEVICE, exact_float32, needs_device  # noqa: F401 (a fixture)
from test_oracle import (  # noqa: F401 (collected here with this module's `runner`)
    test_batch_of_different_lengths_in_one_step,
    test_cached_prompt_matches_plain_run,
    test_chunked_prefill,
    test_fully_cached_prompt_alongside_its_twin_in_same_step,
    test_garbage_in_unwritten_cache_slots_is_never_read,
    test_identical_prompts_share_pending_blocks_in_one_step,
    test_mixed_prefill_and_decode_steps,
    test_sample_false_returns_none_and_empty_batch,
    test_single_prompts_match_transformers,
)

pytestmark = [needs_device, pytest.mark.usefixtures("exact_float32")]


@pytest.fixture(scope="module")
def device_runners(checkpoints):
    """One float32 runner per architecture on the test device, as conftest's `runners`."""
    from kvserve.model import ModelRunner

    return {
        arch: ModelRunner(
            ck.path, block_size=4, num_blocks=96, device=DEVICE, dtype="float32", num_threads=1
        )
        for arch, ck in checkpoints.items()
    }


@pytest.fixture
def runner(checkpoint, device_runners):
    found = device_runners[checkpoint.arch]
    assert found.device.type == DEVICE.split(":")[0]
    return found
