"""The event mirror `kvserve route` keeps (kvserve.events: one PrefixIndex fed by a
subscriber per engine) predicts both ends of a KV transfer exactly: after a producer
prefilled prompts and a consumer pulled their blocks and decoded, the hit it predicts
for each engine equals the cached tokens that engine reports for the next request.
The consumer's pulled blocks are published as what it holds (else its hit would be
predicted short), for full attention, sliding windows and a Mamba2 hybrid."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.events import KVEventSubscriber, PrefixIndex
from tests._ports import free_port

BS = 4
PROMPTS = [[5 + (11 * i + j) % 240 for j in range(40)] for i in range(4)]


def with_events(ck, transfer: dict, **extra) -> tuple[LLM, tuple[str, str]]:
    pub, replay = free_port(), free_port()
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}",
              "replay_endpoint": f"tcp://127.0.0.1:{replay}"}  # fmt: skip
    engine = LLM(ck.path, block_size=BS, dtype="float32", num_threads=1, num_kv_blocks=256,
                 kv_events_config=events, kv_transfer_config=transfer, **extra)  # fmt: skip
    return engine, (f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")


def cached(engine: LLM, prompts) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    return [o.num_cached_tokens for o in engine.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("arch", ["llama", "gemma3", "bamba"])
def test_the_mirror_predicts_both_ends_of_a_transfer(
    arch, checkpoints, gemma3_checkpoint, bamba_checkpoint
):
    ck = {"gemma3": gemma3_checkpoint, "bamba": bamba_checkpoint}.get(arch) or checkpoints[arch]
    port = free_port()
    producer, p_at = with_events(ck, {"kv_role": "kv_producer", "kv_port": port},
                                 offload="cpu:64MiB")  # fmt: skip
    consumer, c_at = with_events(ck, {"kv_role": "kv_consumer", "kv_connector_extra_config":
                                      {"peers": [f"tcp://127.0.0.1:{port}"]}})  # fmt: skip
    index = PrefixIndex()
    subs = {"P": KVEventSubscriber(*p_at, index, engine="P"),
            "C": KVEventSubscriber(*c_at, index, engine="C")}  # fmt: skip
    engines = {"P": producer, "C": consumer}
    try:
        cached(producer, PROMPTS)
        cached(consumer, PROMPTS)  # pulled from the producer
        assert consumer.stats()["external_hit_tokens"] > 0
        more = [[*p, 7, 8, 9, 10, 11, 12, 13, 14] for p in PROMPTS]
        for name, engine in engines.items():
            subs[name].wait_for(engine.engine.kv_events.publisher.last_seq)
            predicted = [index.match(p)[name] for p in more]
            assert all(predicted), f"{name}: no hit predicted {predicted}"
            for prompt, hit in zip(more, predicted, strict=True):
                assert cached(engine, [prompt]) == [hit], f"{name}: predicted {hit}"
                subs[name].wait_for(engine.engine.kv_events.publisher.last_seq)
    finally:
        for sub in subs.values():
            sub.close()
        consumer.shutdown()
        producer.shutdown()
