"""Prefill on one engine, decode on another (kvserve.transfer): the producer computes the
prompts, the consumer pulls their blocks over ZMQ on loopback and decodes; its greedy
tokens equal transformers' (and a lone engine's) for full attention (Llama), sliding
windows beside full attention (Gemma 3) and a Mamba2 hybrid (Bamba). A producer gone is
recomputed: the same tokens, never wrong ones (test_transfer_faults.py: the other faults)."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests._ports import free_port

NEW = 6
PROMPTS = [[3 + (7 * i + j) % 250 for j in range(40)] for i in range(3)]


def engines(ck, tmp_path, num_kv_blocks: int = 96):
    port = free_port()
    common = dict(block_size=4, dtype="float32", num_threads=1, num_kv_blocks=num_kv_blocks)
    producer = LLM(ck.path, offload="cpu:64MiB", **common,
                   kv_transfer_config={"kv_role": "kv_producer", "kv_port": port})  # fmt: skip
    consumer = LLM(ck.path, **common, kv_transfer_config={
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"peers": [f"tcp://127.0.0.1:{port}"], "timeout_s": 1},
    })  # fmt: skip
    return producer, consumer


def prefill(producer: LLM) -> None:
    producer.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)


def decode(consumer: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    return [o.outputs[0].token_ids for o in consumer.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("arch", ["llama", "gemma3", "bamba"])
def test_decode_after_a_remote_prefill_gives_the_same_tokens(
    arch, checkpoints, gemma3_checkpoint, bamba_checkpoint, tmp_path
):
    ck = {"gemma3": gemma3_checkpoint, "bamba": bamba_checkpoint}.get(arch) or checkpoints[arch]
    producer, consumer = engines(ck, tmp_path, num_kv_blocks=256 if arch != "llama" else 96)
    try:
        prefill(producer)
        got = decode(consumer)
        assert got == [ck.reference(p, NEW) for p in PROMPTS]
        stats = consumer.stats()
        assert stats["external_hit_tokens"] > 0  # pulled, not recomputed
        assert stats["prefill_tokens_computed"] < sum(len(p) for p in PROMPTS) // 2
        assert consumer.engine.manager.pool.num_used == 0  # nothing held after
    finally:
        consumer.shutdown()
        producer.shutdown()


def test_a_producer_gone_is_recomputed(checkpoints, tmp_path):
    ck = checkpoints["llama"]
    producer, consumer = engines(ck, tmp_path)
    prefill(producer)
    producer.shutdown()  # its server closes: the consumer's asks time out
    try:
        assert decode(consumer) == [ck.reference(p, NEW) for p in PROMPTS]
        assert consumer.stats()["external_hit_tokens"] == 0
    finally:
        consumer.shutdown()


def test_two_engines_that_both_produce_and_consume_serve_only_their_own_blocks(checkpoints):
    """kv_both, each the other's peer: a producer answers from its own tiers, never by
    asking its peers in turn (two servers waiting on each other until both time out)."""
    ck = checkpoints["llama"]
    ports = free_port(), free_port()
    both = [
        LLM(ck.path, block_size=4, dtype="float32", num_threads=1, num_kv_blocks=96,
            offload="cpu:64MiB", kv_transfer_config={
                "kv_role": "kv_both", "kv_port": ports[i],
                "kv_connector_extra_config": {"peers": [f"tcp://127.0.0.1:{ports[1 - i]}"],
                                              "timeout_s": 1}})
        for i in range(2)
    ]  # fmt: skip
    a, b = both
    try:
        prefill(a)
        assert decode(b) == [ck.reference(p, NEW) for p in PROMPTS]
        assert b.stats()["external_hit_tokens"] > 0
        stats = [e.engine.tiers.transfer_stats() for e in both]
        assert [s["failed_asks"] for s in stats] == [0, 0]
    finally:
        b.shutdown()
        a.shutdown()


def test_a_consumer_told_of_its_producers_while_it_runs(checkpoints, tmp_path):
    """`discover`: no peers at start; each producer (on a port ZMQ picked) told of before the
    requests whose blocks it holds, as kvserve.ray tells a decode replica. One gone is asked
    once, then dropped; its replacement on another port is pulled from."""
    ck = checkpoints["llama"]
    common = dict(block_size=4, dtype="float32", num_threads=1, num_kv_blocks=96)
    consumer = LLM(ck.path, **common, kv_transfer_config={
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"discover": True, "timeout_s": 1},
    })  # fmt: skip

    def producer() -> tuple[LLM, str]:
        llm = LLM(ck.path, offload="cpu:64MiB", **common,
                  kv_transfer_config={"kv_role": "kv_producer", "kv_port": 0})  # fmt: skip
        return llm, llm.engine.tiers.server.endpoint

    producers = consumer.engine.tiers.producers
    first, where = producer()
    try:
        assert not where.endswith(":*") and producers.endpoints == []
        prefill(first)
        producers.tell(where)
        assert decode(consumer) == [ck.reference(p, NEW) for p in PROMPTS]
        pulled = consumer.stats()["external_hit_tokens"]
        assert pulled > 0
        first.shutdown()
        second, elsewhere = producer()
        assert elsewhere != where
        try:
            shifted = [[t + 1 for t in p] for p in PROMPTS]  # not in the consumer's cache
            params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
            second.generate(shifted, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
            producers.tell(elsewhere)
            outs = consumer.generate(shifted, params, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == [ck.reference(p, NEW) for p in shifted]
            assert consumer.stats()["external_hit_tokens"] > pulled
            producers.tell(where)  # the one gone: asked once, then dropped
            consumer.generate([[t + 2 for t in PROMPTS[0]]], params, use_tqdm=False)
            assert where not in producers.endpoints and elsewhere in producers.endpoints
            assert consumer.engine.manager.pool.num_used == 0
        finally:
            second.shutdown()
    finally:
        consumer.shutdown()
