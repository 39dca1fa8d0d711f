"""vLLM #44409 end to end: local prefix hits plus external blocks on a 3-group hybrid.

A Gemma 3 with two sliding-window layers and one global layer (three KV cache
groups) and a device pool so small that the blocks of the local hit sit at
the head of the free queue: taking new and external blocks for one group
before another group's hit would evict that hit. The request must hit both
locally and from the CPU tier, produce transformers' tokens, and every
invariant must hold after every step.
"""

from __future__ import annotations

import torch
from _cache_seqs import add_seq

from kvserve import LLM, SamplingParams
from kvserve.kvcache import CacheSequence
from kvserve.kvcache.invariants import check_invariants

G = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def prompt(n: int, salt: int) -> list[int]:
    gen = torch.Generator().manual_seed(100 * salt + n)
    return torch.randint(3, 300, (n,), generator=gen).tolist()


def check(llm: LLM) -> None:
    engine = llm.engine
    held = engine.scheduler.running
    computed = {r.request_id: r.num_computed_tokens for r in held}
    check_invariants(engine.manager, computed)


def run_checked(llm: LLM, request_id: str, tokens: list[int]) -> list[int]:
    engine = llm.engine
    engine.add_request(request_id, tokens, G)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == request_id:
                out = o
        check(llm)
    assert out is not None and out.finished
    return out.outputs[0].token_ids


def interleaving_would_evict(manager, hit, seq) -> bool:
    """Whether taking each group's new blocks before the next group's hit evicts a hit."""
    free = manager.pool.free_block_ids()
    hits = [{b.block_id for b in blocks if b.block_id} for blocks in hit.blocks]
    taken: set[int] = set()
    pos = 0
    for g, group in enumerate(manager.groups):
        for _ in range(max(0, group.num_new_blocks(seq, len(seq.token_ids), len(hit.blocks[g])))):
            while free[pos] in taken:
                pos += 1
            if any(free[pos] in later for later in hits[g + 1 :]):
                return True
            pos += 1
        taken |= hits[g]
    return False


def test_local_hits_and_external_blocks_on_three_groups(gemma3_3groups_checkpoint):
    ck = gemma3_3groups_checkpoint
    llm = LLM(ck.path, block_size=4, dtype="float32", num_threads=1, num_kv_blocks=32,
              max_num_batched_tokens=8, offload="cpu:16MiB")  # fmt: skip
    engine = llm.engine
    assert len(engine.manager.groups) == 3
    x, y = prompt(16, 1), prompt(16, 2)
    run_checked(llm, "a", x + y)  # x and y reach the CPU tier
    for j in range(4):  # unrelated prompts evict everything from the pool
        run_checked(llm, f"junk{j}", prompt(30, 10 + j))
    run_checked(llm, "b", x + prompt(8, 5))  # x again (from the tier), y not
    # Another request takes the older free blocks: x's blocks move to the head.
    other = prompt(12, 7)
    engine.add_request("d", other, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    for _ in range(3):
        engine.step()
        check(llm)
    target = x + y + prompt(3, 4)
    probe = CacheSequence("probe", list(target))
    probe = add_seq(engine.manager, probe)
    hit = engine.manager.get_computed_blocks(probe.request_id, 0)
    assert hit.num_tokens == 16
    assert interleaving_would_evict(engine.manager, hit, probe)
    engine.manager.remove_request("probe")
    before = llm.stats()
    engine.add_request("c", target, G)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outputs[o.request_id] = o.outputs[0].token_ids
        check(llm)
    after = llm.stats()
    assert after["prefix_hit_tokens"] - before["prefix_hit_tokens"] == 16
    assert after["external_hit_tokens"] - before["external_hit_tokens"] == 16
    assert outputs["c"] == ck.reference(target, 4)
    assert outputs["d"] == ck.reference(other, 30)
    assert engine.manager.pool.num_used == 0
