"""Tier contents as KV events: medium CPU / STORAGE, one hash block per group, exact.

A subscriber that applies the stream must know exactly what each tier holds:
stored minus removed equals the tier's keys, each hash stored once while held.
"""

from __future__ import annotations

import torch

from kvserve import LLM, SamplingParams
from kvserve.kvcache.events import BlockRemoved, BlockStored, wire_hash
from tests._ports import free_port


def prompt(n: int, salt: int) -> list[int]:
    gen = torch.Generator().manual_seed(300 * salt + n)
    return torch.randint(3, 300, (n,), generator=gen).tolist()


def test_tier_events_describe_exactly_what_each_tier_holds(checkpoints, tmp_path):
    ck = checkpoints["qwen3"]
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{free_port()}",
        "replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
    }
    # A CPU tier of a few blocks' worth, so it evicts; a disk tier that keeps all.
    llm = LLM(ck.path, block_size=4, dtype="float32", num_threads=1, num_kv_blocks=24,
              kv_events_config=config,
              offload=f"cpu:40KiB,disk:{tmp_path / 'kv'}:64MiB")  # fmt: skip
    engine = llm.engine
    batches = []
    publish = engine.kv_events.publisher.publish

    def spy(events):
        batches.append(list(events))
        return publish(events)

    engine.kv_events.publisher.publish = spy
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    shared = prompt(20, 1)
    llm.generate([shared + prompt(9, 2 + i) for i in range(6)], greedy, use_tqdm=False)
    llm.generate([prompt(30, 9)], greedy, use_tqdm=False)
    llm.shutdown()  # flushes the disk writes and publishes their events

    store = engine.connector.store
    for tier in store.tiers:
        held: set[tuple[int, int]] = set()
        stored = removed = 0
        for events in batches:
            for e in events:
                if getattr(e, "medium", None) != tier.medium:
                    continue
                if isinstance(e, BlockStored):
                    assert e.block_size == 4
                    assert len(e.token_ids) == 4 * len(e.block_hashes)
                    for h in e.block_hashes:
                        assert (e.group_idx, h) not in held, "stored twice without a removal"
                        held.add((e.group_idx, h))
                        stored += 1
                elif isinstance(e, BlockRemoved):
                    for h in e.block_hashes:
                        held.remove((e.group_idx, h))  # only what was advertised
                        removed += 1
        keys = tier.keys()  # a Tier method, not a dict
        expected = {(k[0], wire_hash(k[1:])) for k in keys}
        assert held == expected, tier.medium
        assert stored > 0
        if tier.medium == "CPU":
            assert removed > 0  # the small CPU tier evicted
            assert tier.used_bytes <= tier.capacity
