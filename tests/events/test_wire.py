"""Wire compatibility: our payloads decode with a schema written from vLLM's documented structures.

The schema below is independent of kvserve (and vLLM is not imported): the
batch is an array [ts, events, data_parallel_rank]; each event a map tagged
"type"; BlockStored's first seven fields are required. Unknown fields are
forbidden, so anything we add that vLLM does not know fails here.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import zmq
from _cache_seqs import add_seq

from kvserve.events import make_engine_events
from kvserve.kvcache import CacheSequence, KVCacheConfig, KVCacheManager
from kvserve.kvcache.specs import spec_from_name

Hash = int | bytes


class VBlockStored(msgspec.Struct, tag="BlockStored", forbid_unknown_fields=True):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VBlockRemoved(msgspec.Struct, tag="BlockRemoved", forbid_unknown_fields=True):
    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None = None


class VAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", forbid_unknown_fields=True):
    pass


class VBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]
    data_parallel_rank: int | None = None


decoder = msgspec.msgpack.Decoder(VBatch)


def test_payloads_decode_with_vllms_schema(ports):
    manager = KVCacheManager(
        KVCacheConfig(
            num_blocks=10, block_size=4, specs=[spec_from_name(g, 4) for g in ("full", "sliding:5")]
        )
    )
    events = make_engine_events(manager, ports.config(topic="kv"))
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(ports.connect)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(ports.replay_connect)
    try:
        time.sleep(0.2)
        for i in range(6):  # evictions from the third request on
            with events.lock:
                seq = CacheSequence(f"r{i}", [i] * 9, lora_name="lora" if i % 2 else None)
                seq = add_seq(manager, seq)
                assert manager.allocate_slots(seq.request_id, 9, 0)
                manager.end_step()
                manager.free(seq.request_id)
                events.end_step()
        with events.lock:
            assert manager.reset_prefix_cache()
            events.end_step()
        kinds: set[type] = set()
        live = []
        for expected_seq in range(7):
            assert sub.poll(3000)
            topic, seq_bytes, payload = sub.recv_multipart()
            assert topic == b"kv" and int.from_bytes(seq_bytes, "big") == expected_seq
            batch = decoder.decode(payload)
            assert batch.data_parallel_rank == 0 and batch.ts > 0
            kinds.update(type(e) for e in batch.events)
            live.append(payload)
        assert kinds == {VBlockStored, VBlockRemoved, VAllBlocksCleared}
        stored = [e for p in live for e in decoder.decode(p).events if type(e) is VBlockStored]
        assert all(isinstance(h, int) and 0 <= h < 2**64 for e in stored for h in e.block_hashes)
        assert {e.kv_cache_spec_kind for e in stored} == {"full_attention", "sliding_window"}
        # vLLM's replay protocol: 8-byte start seq; [seq, payload] frames; then seq -1.
        dealer.send_multipart([b"", (3).to_bytes(8, "big")])
        replayed = []
        while True:
            assert dealer.poll(3000)
            _, seq_bytes, payload = dealer.recv_multipart()
            if int.from_bytes(seq_bytes, "big", signed=True) == -1:
                assert payload == b""
                break
            replayed.append((int.from_bytes(seq_bytes, "big"), payload))
        assert replayed == list(enumerate(live))[3:]
    finally:
        sub.close(linger=0)
        dealer.close(linger=0)
        events.close()
