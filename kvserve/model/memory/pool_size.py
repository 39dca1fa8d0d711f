"""The KV pool's size on CUDA: a share of the device's total memory, after the weights
and a profiled activation peak (kvserve.model.memory.kv_memory.gpu_kv_cache_memory does the
arithmetic; this file measures its inputs)."""

from __future__ import annotations

import gc
import logging
from typing import Any

import torch

from kvserve.model.memory.kv_memory import GiB, gpu_kv_cache_memory
from kvserve.model.memory.scratch import dummy_chunks, scratch_cache

logger = logging.getLogger(__name__)


def profile_steps(
    max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int
) -> list[list[tuple[int, int]]]:
    """The largest steps the scheduler can form, as (sequences, tokens each) per step:
    the token budget in sequences as long as the model allows (attention's peak), and
    spread over as many sequences as may run (the sampler's logits rows)."""
    budget = max_num_batched_tokens
    longest = min(budget, max_model_len)
    long_step = [(budget // longest, longest)]
    if budget % longest:
        long_step.append((1, budget % longest))
    widest = min(max_num_seqs, budget)
    return [long_step, [(widest, budget // widest)]]


def run_profile_steps(runner: Any, max_num_batched_tokens: int, max_num_seqs: int) -> None:
    """The largest steps, as dummy steps on a scratch cache (any device)."""
    with scratch_cache(runner):
        for step in profile_steps(max_num_batched_tokens, max_num_seqs, runner.max_model_len):
            chunks = [
                chunk
                for part, (num_seqs, num_tokens) in enumerate(step)
                for chunk in dummy_chunks(runner, num_seqs, num_tokens, tag=f"profile{part}")
            ]
            runner.execute(chunks)


def activation_peak(runner: Any, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """Bytes the largest steps allocate beyond what is allocated before them (CUDA)."""
    device = runner.device
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    run_profile_steps(runner, max_num_batched_tokens, max_num_seqs)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def cuda_kv_cache_memory(
    runner: Any, utilization: float, max_num_batched_tokens: int, max_num_seqs: int
) -> int:
    """The pool's bytes: `utilization` of the device's total memory, less what is in use
    now (this process's weights, other processes, an earlier LLM still alive) and the
    activation peak of the largest step."""
    gc.collect()  # an LLM dropped inside a reference cycle gives its memory back first
    torch.cuda.empty_cache()
    peak = activation_peak(runner, max_num_batched_tokens, max_num_seqs)
    torch.cuda.empty_cache()  # the profile's activations are not "in use"
    free, total = torch.cuda.mem_get_info(runner.device)
    budget = gpu_kv_cache_memory(
        total=total,
        in_use=total - free,
        activation_peak=peak,
        utilization=utilization,
        block_bytes=runner.bytes_per_block,
    )
    logger.info(
        "GPU memory: %.2f GiB total, %.2f GiB in use, activation peak %.2f GiB, "
        "KV cache %.2f GiB (gpu_memory_utilization %g)",
        total / GiB,
        (total - free) / GiB,
        peak / GiB,
        budget / GiB,
        utilization,
    )
    return budget
