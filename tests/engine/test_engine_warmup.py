"""A warm-up between requests changes nothing a request can see: its tokens, the prefix
cache's hits, the pool's contents. (On the CPU the engine skips it at start; here it runs
on the engine's own runner, mid-life.)"""

from __future__ import annotations

import logging

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.memory.warmup import warm_up
from tests._ports import free_port

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 17, 42, 9, 100, 3, 7, 11, 60], [8, 1, 2, 250, 19]]


def make(path: str, **kwargs) -> LLM:
    return LLM(path, block_size=4, num_kv_blocks=48, dtype="float32", num_threads=1, **kwargs)


def tokens(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def events_config() -> dict:
    """KV events published over ZMQ on a free loopback port."""
    return {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{free_port()}"}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "bamba"])
def test_a_warm_up_between_requests_changes_no_output_and_no_hit(
    arch, checkpoints, gemma3_checkpoint, bamba_checkpoint
):
    path = {"qwen3": checkpoints["qwen3"], "gemma3": gemma3_checkpoint, "bamba": bamba_checkpoint}
    path = path[arch].path
    plain = make(path)
    warmed = make(path, kv_events_config=events_config())
    first = tokens(warmed, GREEDY)
    events = warmed.engine.kv_events
    pool = [t.clone() for pair in warmed.engine.runner.kv_tensors for t in pair]
    hits = warmed.stats()["prefix_hit_tokens"]
    warm_up(warmed.engine.runner, max_num_seqs=8, max_num_batched_tokens=64)
    after = [t for pair in warmed.engine.runner.kv_tensors for t in pair]
    # Bit for bit: slots never written hold whatever was there (NaN is no error).
    assert all(same_bits(a, b) for a, b in zip(pool, after, strict=True))
    with events.lock:
        assert events.end_step() is None  # the warm-up recorded no KV event
    # The same prompts again hit the blocks cached before the warm-up, and decode alike.
    again = warmed.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == first == tokens(plain, GREEDY)
    assert warmed.stats()["prefix_hit_tokens"] > hits
    assert all(o.num_cached_tokens > 0 for o in again)
    # The runner's shared generator is where it was: unseeded sampling goes on alike.
    assert tokens(warmed, SEEDED) == tokens(plain, SEEDED)
    warmed.shutdown()


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
def test_on_cuda_the_engine_warms_up_at_start_and_decodes_alike(checkpoints, caplog):
    path = checkpoints["qwen3"].path
    with caplog.at_level(logging.INFO, logger="kvserve.model.memory.warmup"):
        warmed = LLM(path, block_size=16, dtype="float32", device="cuda", num_kv_blocks=256)
    assert "warm-up: " in caplog.text
    cold = LLM(path, block_size=16, dtype="float32", device="cuda", num_kv_blocks=256, warmup=False)
    assert tokens(warmed, GREEDY) == tokens(cold, GREEDY)
