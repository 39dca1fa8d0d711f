"""Event emission by the KV cache (no transport): once, lined up, exact enough to predict hits."""

from __future__ import annotations

import random

import msgspec
import pytest

from kvserve.engine.model_free_runner import ModelFreeRunner
from kvserve.engine.request import Request
from kvserve.engine.scheduler import Scheduler, SchedulerConfig
from kvserve.events.index import EngineView
from kvserve.kvcache import CacheSequence, KVCacheConfig, KVCacheManager
from kvserve.kvcache.event_metadata import kv_events_metadata
from kvserve.kvcache.event_sink import KVEventSink
from kvserve.kvcache.event_snapshot import snapshot_events
from kvserve.kvcache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
    wire_hash,
    wire_hash_u64,
)
from kvserve.kvcache.specs import FullAttentionSpec, spec_from_name

BS = 4


def make(num_blocks: int, groups=("full",), int_hashes: bool = True):
    m = KVCacheManager(
        KVCacheConfig(
            num_blocks=num_blocks,
            block_size=BS,
            specs=[spec_from_name(g, BS) for g in groups],
        )
    )
    sink = KVEventSink(BS, int_block_hashes=int_hashes)
    sink.attach(m)
    return m, sink


def prefill(m, seq):
    m.add_sequence(seq)
    hit = m.get_computed_blocks(seq)
    assert m.allocate_slots(seq, len(seq.token_ids) - hit.num_tokens, hit.num_tokens, hit)
    m.end_step()
    return hit


def test_disabled_by_default_and_u64_is_vllms_conversion():
    m = KVCacheManager(KVCacheConfig(num_blocks=8, block_size=BS))
    assert m.pool.events is None
    h = bytes(range(32))
    assert wire_hash(h) == wire_hash_u64(h) == int.from_bytes(h[-8:], "big")
    assert wire_hash(h, int_block_hashes=False) == h


def test_one_stored_event_per_run_lined_up_with_its_hashes():
    m, sink = make(32, int_hashes=False)
    a = CacheSequence("a", list(range(11)))  # 2 full blocks + 3 tokens
    prefill(m, a)
    (e,) = sink.take()
    assert isinstance(e, BlockStored)
    assert e.block_hashes == a.block_hashes[:2] and e.parent_block_hash is None
    assert e.token_ids == list(range(8)) and e.block_size == BS and e.group_idx == 0
    assert (e.medium, e.kv_cache_spec_kind, e.lora_id) == ("GPU", "full_attention", None)
    # Decode fills block 2: a new run whose parent is block 1.
    a.token_ids.append(11)
    assert m.allocate_slots(a, 1, 11)
    (e,) = sink.take()
    assert e.block_hashes == [a.block_hashes[2]] and e.parent_block_hash == a.block_hashes[1]
    # An identical prompt hits, and a duplicate-content decode block merges: no event.
    b = CacheSequence("b", [*list(range(12)), 99])
    prefill(m, b)
    assert sink.take() == []


def test_two_groups_same_step_share_pending_blocks_once():
    m, sink = make(64, groups=("full", "sliding:6"))
    a, b = CacheSequence("a", [1] * 9), CacheSequence("b", [1] * 9)
    for seq in (a, b):
        m.add_sequence(seq)
        hit = m.get_computed_blocks(seq)
        assert m.allocate_slots(seq, 9 - hit.num_tokens, hit.num_tokens, hit)
    events = sink.take()
    assert [(e.group_idx, len(e.block_hashes)) for e in events] == [(0, 2), (1, 2)]
    assert events[1].kv_cache_spec_sliding_window == 6
    assert events[1].kv_cache_spec_kind == "sliding_window"


def test_removed_once_per_eviction_and_cleared_on_reset():
    m, sink = make(6)
    for i in range(4):
        seq = CacheSequence(f"s{i}", [i] * 9)
        prefill(m, seq)
        m.free(seq)
    events = sink.take()
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert len(removed) == m.pool.num_evictions > 0
    assert all(len(e.block_hashes) == 1 for e in events if isinstance(e, BlockRemoved))
    assert set(removed) <= set(stored) and len(set(stored)) == len(stored)
    assert m.reset_prefix_cache()
    assert isinstance(sink.take()[-1], AllBlocksCleared)


def test_batch_wire_layout_is_array_with_type_tagged_maps():
    m, sink = make(16)
    prefill(m, CacheSequence("a", list(range(9)), lora_name="ad", cache_salt="t"))
    payload = encode_batch(KVEventBatch(1.5, sink.take(), 0))
    raw = msgspec.msgpack.decode(payload)
    assert isinstance(raw, list) and raw[0] == 1.5 and raw[2] == 0
    (event,) = raw[1]
    assert event["type"] == "BlockStored" and event["lora_name"] == "ad"
    assert event["extra_keys"] == [["ad", "t"], ["ad"]]
    for key in ("lora_id", "medium", "parent_block_hash"):  # required by vLLM's decoder
        assert key in event
    assert decode_batch(payload).events[0].block_hashes == event["block_hashes"]


def test_metadata_tells_how_to_hash():
    m, _ = make(16, groups=("full", "sliding:10"))
    meta = kv_events_metadata(m)
    assert meta["hash_fn"] == "sha256" and meta["hash_seed"] == 0 and meta["anchor_group"] == 0
    g = meta["groups"][1]
    assert (g["kind"], g["block_size"], g["hash_block_size"], g["sliding_window"]) == (
        "sliding_window",
        BS,
        BS,
        10,
    )


# -- exactness: a view fed only by events predicts every hit -----------------------------


def random_requests(rng: random.Random, n: int) -> list[tuple[int, list[int], int]]:
    """(arrival step, prompt, max tokens): a few shared stems, tiny vocab, heavy reuse."""
    stems = [[rng.randrange(3) for _ in range(40)] for _ in range(3)]
    out = []
    for i in range(n):
        stem = stems[rng.randrange(3)]
        prompt = stem[: rng.randrange(1, 40)] + [rng.randrange(3) for _ in range(rng.randrange(4))]
        out.append((i // 2 + rng.randrange(3), prompt, rng.randrange(1, 8)))
    return out


def drive(groups, num_blocks, seed, check_view, snapshot_every=0):
    """A scheduler loop; before each step `check_view(view, scheduler)` gets the event-fed view."""
    m, sink = make(num_blocks, groups=groups)
    view = EngineView.from_metadata(kv_events_metadata(m))
    sched = Scheduler(m, SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=4))
    runner = ModelFreeRunner(vocab_size=3)
    rng = random.Random(seed)
    pending = sorted(random_requests(rng, 40), key=lambda r: r[0])
    step = 0
    while pending or sched.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, prompt, max_tokens = pending.pop(0)
            sched.add_request(Request(f"r{step}-{len(pending)}", prompt, max_tokens=max_tokens))
        view.apply(KVEventBatch(0.0, sink.take()))
        if snapshot_every and step % snapshot_every == 0:
            view.clear()
            view.apply(KVEventBatch(0.0, snapshot_events(m)))
        check_view(view, sched)
        out = sched.schedule()
        finished = sched.update(out, runner.execute(out))
        for req in finished:
            runner.free_request(req.request_id)
        step += 1
    return m


def predictions_match(counter):
    def check(view, sched):
        for req in sched.waiting:
            hashes = [wire_hash(h) for h in req.block_hashes]
            m = sched.manager
            if len(hashes) < len(req.token_ids) // BS:
                m.hasher.extend(req.block_hashes, req.token_ids, req.extra_keys)
                hashes = [wire_hash(h) for h in req.block_hashes]
            expected = m.get_computed_blocks(req, 0).num_tokens
            assert view.hit_tokens(hashes, len(req.token_ids)) == expected, req.request_id
            counter["compared"] += 1
            counter["hits"] += bool(expected)

    return check


LAYOUTS = [("full",), ("full", "sliding:5"), ("full", "sliding:9", "sliding:14")]


@pytest.mark.parametrize("groups", LAYOUTS)
@pytest.mark.parametrize("seed", range(6))
def test_event_fed_view_predicts_every_hit_under_eviction(groups, seed):
    counter = {"compared": 0, "hits": 0}
    m = drive(groups, 16 * len(groups), seed, predictions_match(counter))
    assert counter["hits"] > 0 and m.pool.num_evictions > 0


@pytest.mark.parametrize("groups", LAYOUTS[1:])
@pytest.mark.parametrize("seed", range(3))
def test_snapshot_rebuilds_the_same_predictions(groups, seed):
    counter = {"compared": 0, "hits": 0}
    drive(groups, 16 * len(groups), seed, predictions_match(counter), snapshot_every=3)
    assert counter["hits"] > 0


def test_snapshot_lists_parents_first():
    m, _sink = make(32)
    prefill(m, CacheSequence("a", list(range(17))))
    events = snapshot_events(m)
    assert isinstance(events[0], AllBlocksCleared)
    seen = set()
    for e in events[1:]:
        assert e.parent_block_hash is None or e.parent_block_hash in seen
        seen.update(e.block_hashes)
    assert len(seen) == 4


def test_full_attention_spec_only_has_no_window():
    assert FullAttentionSpec(block_size=BS).kind == "full_attention"


def test_event_modules_import_neither_torch_nor_zmq():
    import subprocess
    import sys

    mods = "kvserve.kvcache.events, kvserve.kvcache.event_sink, kvserve.kvcache.event_snapshot"
    code = (
        f"import sys, {mods}, kvserve.kvcache.event_metadata; "
        "sys.exit(1 if {'torch', 'zmq'} & set(sys.modules) else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
