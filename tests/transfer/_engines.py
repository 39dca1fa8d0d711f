"""A producer and a consumer engine on loopback, the prompts they share, and the checks
that nothing leaked: the transfer tests' common ground."""

from __future__ import annotations

from typing import Any

from kvserve import LLM, SamplingParams
from kvserve.kvcache import check_invariants
from tests._ports import free_port

NEW = 4
BS = 4
PROMPTS = [[5 + (11 * i + j) % 240 for j in range(40)] for i in range(6)]
RUN = (40 - 1) // BS
"""Hash blocks a consumer can pull for each prompt (the last token is always computed)."""


def producer_engine(ck, cpu: str = "cpu:64MiB", hold_seconds: float | None = None) -> LLM:
    config: dict[str, Any] = {"kv_role": "kv_producer", "kv_port": free_port()}
    if hold_seconds is not None:
        config["kv_connector_extra_config"] = {"hold_seconds": hold_seconds}
    return LLM(ck.path, block_size=BS, dtype="float32", num_threads=1, num_kv_blocks=256,
               offload=cpu, kv_transfer_config=config)  # fmt: skip


def consumer_engine(ck, peer: str, timeout_s: float = 1) -> LLM:
    config = {"kv_role": "kv_consumer",
              "kv_connector_extra_config": {"peers": [peer], "timeout_s": timeout_s}}  # fmt: skip
    return LLM(ck.path, block_size=BS, dtype="float32", num_threads=1, num_kv_blocks=256,
               kv_transfer_config=config)  # fmt: skip


def endpoint(producer: LLM) -> str:
    return producer.engine.tiers.transfer.endpoint


def run(engine: LLM, prompts, new: int = NEW) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    return [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]


def assert_no_leak(*engines: LLM) -> None:
    for engine in engines:
        manager = engine.engine.manager
        assert manager.pool.num_used == 0, "a block is still held after every request ended"
        check_invariants(manager)


def kept(producer: LLM) -> dict[str, float]:
    """The producer's keeping counters, as /metrics exports them (kv_transfer_kept_*)."""
    stats = producer.engine.tiers.transfer_stats()
    return {k.removeprefix("kept_"): v for k, v in stats.items() if k.startswith("kept_")}


def cpu_tier(producer: LLM) -> Any:
    (tier,) = [t for t in producer.engine.connector.store.tiers if t.medium == "CPU"]
    return tier


def remote(consumer: LLM):
    (producers,) = [t for t in consumer.engine.connector.store.tiers if t.medium == "REMOTE"]
    (tier,) = producers.tiers  # the one peer's RemoteTier
    return tier


def stored_per_prompt(ck) -> int:
    """Bytes one of PROMPTS leaves in a producer's CPU tier (each the same)."""
    producer = producer_engine(ck)
    try:
        run(producer, PROMPTS[:1], 1)
        return cpu_tier(producer).used_bytes
    finally:
        producer.shutdown()
