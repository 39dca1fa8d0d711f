"""A sliding-window model, a small pool and the CPU tier: every request that fits runs.

The differential fuzzer's first finding (tests/fuzz), as a user met it: after
earlier prompts finished and left the pool, a prompt sharing a long prefix
with them hit the CPU tier for it and was never scheduled (`step()` returned
nothing on an idle pool, `generate` spun for ever). Each sliding-window group
took a block for every external token although no computed token reads
those before its window, so the request needed more blocks than admission
had promised.
"""

from __future__ import annotations

import torch

from kvserve import LLM, SamplingParams
from kvserve.kvcache import check_invariants

G = SamplingParams(temperature=0, max_tokens=4)


def tokens(n: int, salt: int) -> list[int]:
    gen = torch.Generator().manual_seed(500 + salt)
    return torch.randint(3, 300, (n,), generator=gen).tolist()


def run(llm: LLM, prompt: list[int], steps: int = 400) -> list[int]:
    """Step the engine by hand with a budget: a request left waiting fails the test."""
    engine = llm.engine
    engine.add_request("r", prompt, G)
    for _ in range(steps):
        for out in engine.step():
            if out.finished:
                return list(out.outputs[0].token_ids)
        running = {r.request_id: r.num_computed_tokens for r in engine.scheduler.running}
        check_invariants(engine.manager, running)
    raise AssertionError(f"not finished after {steps} steps (pool: {llm.stats()})")


def test_a_tier_hit_on_a_small_pool_is_scheduled(gemma3_checkpoint):
    ck = gemma3_checkpoint
    llm = LLM(ck.path, block_size=4, num_kv_blocks=34, dtype="float32", device="cpu",
              num_threads=1, max_num_batched_tokens=4, offload="cpu:16MiB")  # fmt: skip
    base = tokens(40, 0)
    run(llm, base)
    for salt in (1, 2, 3):  # unrelated prompts push base's blocks out of the pool
        run(llm, tokens(40, salt))
    before = llm.stats()["external_hit_tokens"]
    prompt = [*base[:38], 5, 6, 7]
    assert run(llm, prompt) == ck.reference(prompt, 4)
    assert llm.stats()["external_hit_tokens"] - before == 36  # from the tier
    assert llm.engine.manager.pool.num_used == 0
