"""`LLM.shutdown()` and garbage collection give the weights and the KV pool back; on
CUDA a second LLM in the same process then gets a pool as large as the first."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from kvserve import LLM, SamplingParams
from tests._ports import free_port

GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
PROMPT = [5, 17, 42, 9, 100, 3, 7]


def make(path: str, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 32)
    return LLM(path, block_size=4, dtype="float32", num_threads=1, device="cpu", **kwargs)


def events_config() -> dict:
    """KV events published over ZMQ on a free loopback port."""
    return {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{free_port()}"}


def watch(llm: LLM) -> list[weakref.ref]:
    """Weak references to every K/V tensor and every model parameter of `llm`."""
    runner = llm.engine.runner
    refs = [weakref.ref(t) for pair in runner.kv_tensors for t in pair]
    refs += [weakref.ref(p) for p in runner.model.parameters()]
    assert len(refs) > 2 * len(runner.kv_tensors)
    return refs


def alive(refs: list[weakref.ref]) -> int:
    return sum(ref() is not None for ref in refs)


@pytest.mark.parametrize("offload", [None, "cpu:1MiB"])
def test_shutdown_drops_the_weights_and_the_pool(checkpoints, offload):
    # With tiers, their block I/O holds the runner's tensor list: it lets go too.
    llm = make(checkpoints["qwen3"].path, offload=offload)
    assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    refs = watch(llm)
    llm.shutdown()
    assert alive(refs) == 0  # the LLM itself is still referenced here
    assert llm.stats()["num_kv_blocks"] == 32  # counters stay readable


def test_work_after_shutdown_is_refused_in_one_line(checkpoints):
    llm = make(checkpoints["qwen3"].path)
    llm.shutdown()
    llm.shutdown()  # twice is fine
    for work in (
        lambda: llm.generate(PROMPT, GREEDY, use_tqdm=False),
        lambda: llm.engine.step(),
    ):
        with pytest.raises(RuntimeError, match="shut down") as info:
            work()
        assert "\n" not in str(info.value)


def test_a_dropped_llm_frees_the_weights_and_the_pool_without_a_collector(checkpoints):
    llm = make(checkpoints["qwen3"].path)
    llm.generate(PROMPT, GREEDY, use_tqdm=False)
    refs = watch(llm)
    gc.collect()
    gc.disable()  # no reference cycle may keep them: reference counting alone frees them
    try:
        del llm
        left = alive(refs)
    finally:
        gc.enable()
    assert left == 0


def test_a_dropped_llm_with_events_and_tiers_is_collected(checkpoints):
    llm = make(checkpoints["qwen3"].path, offload="cpu:1MiB", kv_events_config=events_config())
    assert llm.engine.kv_events is not None
    llm.generate(PROMPT, GREEDY, use_tqdm=False)
    refs = watch(llm)
    llm.shutdown()  # the publisher's thread ends
    del llm
    gc.collect()
    assert alive(refs) == 0


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
def test_a_second_llm_gets_a_pool_as_large_as_the_first(checkpoints):
    path = checkpoints["qwen3"].path
    first = LLM(path, block_size=16, device="cuda", max_num_batched_tokens=512)
    blocks = first.stats()["num_kv_blocks"]
    first.shutdown()
    second = LLM(path, block_size=16, device="cuda", max_num_batched_tokens=512)
    assert second.stats()["num_kv_blocks"] >= 0.98 * blocks
    del second  # dropped, not shut down: garbage collection gives the pool back
    third = LLM(path, block_size=16, device="cuda", max_num_batched_tokens=512)
    assert third.stats()["num_kv_blocks"] >= 0.98 * blocks
    third.shutdown()


@cuda
def test_the_pool_is_the_share_of_total_memory_and_a_tiny_share_is_refused(checkpoints):
    path = checkpoints["qwen3"].path
    free, total = torch.cuda.mem_get_info()
    llm = LLM(path, block_size=16, device="cuda", gpu_memory_utilization=0.5)
    pool = llm.stats()["num_kv_blocks"] * llm.engine.runner.bytes_per_block
    in_use = total - free  # this process's CUDA context, other processes
    assert 0.5 * total - in_use - 2**30 <= pool <= 0.5 * total
    llm.shutdown()
    with pytest.raises(ValueError, match=r"gpu_memory_utilization 1e-05 of .* GiB leaves"):
        LLM(path, block_size=16, device="cuda", gpu_memory_utilization=1e-5)
