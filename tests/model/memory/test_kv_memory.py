"""The KV pool's budget arithmetic and the dummy steps' shapes, as plain numbers."""

from __future__ import annotations

import pytest

from kvserve.model.memory.kv_memory import GiB, gpu_kv_cache_memory
from kvserve.model.memory.pool_size import profile_steps
from kvserve.model.memory.warmup import warmup_shapes

MiB = 1 << 20


def budget(**changes) -> int:
    numbers = dict(
        total=80 * GiB, in_use=2 * GiB, activation_peak=3 * GiB, utilization=0.9, block_bytes=MiB
    )
    return gpu_kv_cache_memory(**{**numbers, **changes})


def test_the_pool_is_a_share_of_total_memory_after_what_is_in_use_and_the_peak():
    assert budget() == int(80 * GiB * 0.9) - 2 * GiB - 3 * GiB
    assert budget(utilization=1) == 75 * GiB
    # Of the total, not of what is free: more in use (another LLM alive) leaves less.
    assert budget(in_use=40 * GiB) == budget() - 38 * GiB
    assert budget(activation_peak=0) - budget() == 3 * GiB


@pytest.mark.parametrize(
    "changes",
    [
        dict(utilization=0.05),  # 4 GiB of 80 minus 5 in use and peak
        dict(in_use=75 * GiB),
        dict(total=8 * GiB, in_use=4 * GiB, activation_peak=4 * GiB),  # the peak is too big
        dict(block_bytes=int(67 * GiB)),  # 67 GiB left: one block, not the two needed
    ],
)
def test_a_pool_that_does_not_fit_is_one_line_naming_the_option_and_numbers(changes):
    with pytest.raises(ValueError, match="gpu_memory_utilization") as info:
        budget(**changes)
    message = str(info.value)
    assert "\n" not in message
    total = changes.get("total", 80 * GiB) / GiB
    assert f"of {total:.2f} GiB" in message
    assert f"after {changes.get('in_use', 2 * GiB) / GiB:.2f} GiB in use" in message
    assert f"{changes.get('activation_peak', 3 * GiB) / GiB:.2f} GiB activation peak" in message


def test_two_blocks_are_the_least_that_fits():
    edge = dict(total=10 * GiB, utilization=0.5, activation_peak=0, block_bytes=MiB)
    assert budget(**edge, in_use=5 * GiB - 2 * MiB) == 2 * MiB
    with pytest.raises(ValueError, match="fewer than 2 blocks of 1048576 bytes"):
        budget(**edge, in_use=5 * GiB - 2 * MiB + 1)


@pytest.mark.parametrize("share", [0, -0.1, 1.2, float("nan")])
def test_a_share_outside_0_1_is_refused(share):
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        budget(utilization=share)


@pytest.mark.parametrize(
    ("budget_tokens", "max_seqs", "max_len"),
    [(8192, 256, 40960), (8192, 256, 512), (1100, 8, 512), (64, 256, 512), (7, 3, 4)],
)
def test_profile_steps_are_the_largest_steps_the_scheduler_can_form(
    budget_tokens, max_seqs, max_len
):
    long_step, wide_step = profile_steps(budget_tokens, max_seqs, max_len)
    # The whole budget, in sequences no longer than the model allows, as long as it allows.
    assert sum(n * t for n, t in long_step) == budget_tokens
    assert max(t for _, t in long_step) == min(budget_tokens, max_len)
    assert all(t <= max_len for _, t in long_step)
    # As many sampled rows as may run at once.
    ((rows, tokens),) = wide_step
    assert rows == min(max_seqs, budget_tokens) and 1 <= tokens <= max_len
    assert rows * tokens <= budget_tokens


def test_warmup_shapes_bucket_prefills_and_decodes():
    shapes = warmup_shapes(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=40960)
    prefills = [t for n, t, start in shapes if start == 0]
    decodes = [n for n, t, start in shapes if start > 0]
    assert prefills == [16, 64, 256, 1024, 4096, 8192]
    assert decodes == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert all(t == 1 for n, t, start in shapes if start > 0)


def test_warmup_shapes_stay_inside_the_limits():
    shapes = warmup_shapes(max_num_seqs=6, max_num_batched_tokens=100, max_model_len=20)
    assert [t for _, t, start in shapes if start == 0] == [16, 20]
    assert [n for n, _, start in shapes if start > 0] == [1, 2, 4, 6]
    assert all(start + t <= 20 for _, t, start in shapes)
    # A budget smaller than the first bucket: one prefill of the budget, decodes within it.
    small = warmup_shapes(max_num_seqs=256, max_num_batched_tokens=3, max_model_len=512)
    assert small == [(1, 3, 0), (1, 1, 32), (2, 1, 32), (3, 1, 32)]
