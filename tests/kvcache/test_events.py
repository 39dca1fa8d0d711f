"""Event emission by the KV cache (no transport): once, lined up, exact enough to predict hits."""

from __future__ import annotations

import random

import msgspec
import pytest
from _cache_seqs import add_seq

from kvserve.engine.model_free_runner import ModelFreeRunner
from kvserve.engine.request import Request
from kvserve.engine.scheduler import Scheduler, SchedulerConfig, sampled_tokens
from kvserve.events.index import ROOT, EngineView
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
from kvserve.kvcache.specs import FullAttentionSpec, inflate_for_state, spec_from_name
from kvserve.sampling_params import SamplingParams

BS = 4


def execute(runner, out, manager):
    """One runner step over the scheduler's plans: request id -> sampled token."""
    chunks = out.seq_chunks(manager)
    return sampled_tokens(chunks, runner.execute(chunks))


def make(num_blocks: int, groups=("full",), int_hashes: bool = True):
    """A manager with events; 'mamba:<k>' groups inflate attention blocks to k hash blocks."""
    m = KVCacheManager(
        KVCacheConfig(
            num_blocks=num_blocks,
            block_size=BS,
            specs=inflate_for_state([spec_from_name(g, BS) for g in groups]),
        )
    )
    sink = KVEventSink(BS, int_block_hashes=int_hashes)
    m.attach_events(sink)
    return m, sink


def prefill(m, seq):
    seq = add_seq(m, seq)
    hit = m.get_computed_blocks(seq.request_id)
    assert not hit.wait
    assert m.allocate_slots(
        seq.request_id, len(seq.token_ids) - hit.num_tokens, hit.num_tokens, hit
    )
    m.end_step()
    return hit


class Stream:
    """Per group, what the events say is cached; asserts the stream's rules as it goes."""

    def __init__(self) -> None:
        self.held: dict[int, set] = {}
        self.stored = self.removed = 0
        self.removed_by_group: dict[int, int] = {}

    def apply(self, events) -> None:
        for e in events:
            if isinstance(e, BlockStored):
                held = self.held.setdefault(e.group_idx, set())
                assert e.block_size == BS and len(e.token_ids) == BS * len(e.block_hashes)
                for h in e.block_hashes:
                    assert h not in held, f"group {e.group_idx}: a hash stored twice"
                    held.add(h)
                    self.stored += 1
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    self.held[e.group_idx].remove(h)  # KeyError: removed what is not stored
                    self.removed += 1
                    g = e.group_idx
                    self.removed_by_group[g] = self.removed_by_group.get(g, 0) + 1
            else:
                self.held.clear()


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
    assert m.allocate_slots(a.request_id, 1, 11)
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
        seq = add_seq(m, seq)
        hit = m.get_computed_blocks(seq.request_id)
        assert m.allocate_slots(seq.request_id, 9 - hit.num_tokens, hit.num_tokens, hit)
    events = sink.take()
    assert [(e.group_idx, len(e.block_hashes)) for e in events] == [(0, 2), (1, 2)]
    assert events[1].kv_cache_spec_sliding_window == 6
    assert events[1].kv_cache_spec_kind == "sliding_window"


def test_removed_once_per_eviction_and_cleared_on_reset():
    m, sink = make(6)
    for i in range(4):
        seq = CacheSequence(f"s{i}", [i] * 9)
        prefill(m, seq)
        m.free(seq.request_id)
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


def test_short_prompt_in_an_inflated_block_is_advertised_per_hash_block():
    """vLLM #43258: physical blocks of 16 tokens must not silence a 9-token prompt's events."""
    m, sink = make(32, groups=("full", "mamba:4"), int_hashes=False)
    assert [g.block_size for g in m.groups] == [4 * BS, 4 * BS]
    a = CacheSequence("a", list(range(9)))  # 2 hash blocks + 1 token, inside one physical block
    assert prefill(m, a).num_tokens == 0
    attn, state = sink.take()
    assert attn.block_hashes == a.block_hashes[:2] and attn.parent_block_hash is None
    assert attn.token_ids == list(range(8)) and attn.block_size == BS
    assert (attn.group_idx, attn.kv_cache_spec_kind) == (0, "full_attention")
    # The state after token 8 (the prompt's last hash-block boundary), named by hash block 1.
    assert (
        state.block_hashes == [a.block_hashes[1]] and state.parent_block_hash == a.block_hashes[0]
    )
    assert state.token_ids == list(range(4, 8)) and state.block_size == BS
    assert (state.group_idx, state.kv_cache_spec_kind) == (1, "mamba")
    assert state.kv_cache_spec_sliding_window is None
    view = EngineView.from_metadata(kv_events_metadata(m, int_block_hashes=False))
    view.apply(KVEventBatch(0.0, [attn, state]))
    m.free(a.request_id)
    hashes: list[bytes] = []
    m.hasher.extend(hashes, list(range(13)), (b"", b""))
    # A repeat resumes after token 8; a 3-token prompt has no full hash block to match.
    for prompt, hit in ((list(range(9)), 8), (list(range(13)), 8), ([0, 1, 2], 0)):
        assert view.hit_tokens(hashes[: len(prompt) // BS], len(prompt)) == hit
        b = CacheSequence("b", prompt)
        assert prefill(m, b).num_tokens == hit
        m.free(b.request_id)
    # Only the 13-token prompt added something: hash block 2, and the state after it.
    stream = Stream()
    stream.apply([attn, state, *sink.take()])
    assert stream.held == {0: set(hashes), 1: set(hashes[1:])}


def test_inflated_eviction_removes_every_hash_entry_once():
    """An evicted physical block removes each of its hash entries; snapshots leave once too."""
    m, sink = make(12, groups=("full", "mamba:4"))
    stream = Stream()
    for i in range(8):
        seq = CacheSequence(f"s{i}", [i] * 17)  # 4 hash blocks fill one physical block
        prefill(m, seq)
        m.free(seq.request_id)
        stream.apply(sink.take())
    assert stream.removed == m.pool.num_evictions
    # Whole blocks of 4 entries, and snapshots beyond their share of the pool (3 pages).
    assert stream.removed_by_group[0] % 4 == 0 and stream.removed_by_group[0] >= 4
    assert stream.removed_by_group[1] >= 8 - 3
    # What the events say is cached is exactly what the indexes hold.
    for group in m.groups:
        assert stream.held.get(group.group_id, set()) == {
            wire_hash(h) for h in m.pool.index[group.group_id]
        }
    assert m.reset_prefix_cache()
    assert sink.take() == [AllBlocksCleared()]


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
    assert meta["hit_rule"] == "prefix" and g["verified_against"] == "anchor"


def test_metadata_of_a_state_model_tells_physical_and_hash_block_sizes():
    m, _ = make(16, groups=("full", "mamba:4", "mamba:4"))
    meta = kv_events_metadata(m)
    assert meta["hash_block_size"] == BS and meta["hit_rule"] == "state"
    assert meta["anchor_group"] == 0
    rows = [
        (g["kind"], g["block_size"], g["hash_block_size"], g["verified_against"])
        for g in meta["groups"]
    ]
    assert rows == [
        ("full_attention", 4 * BS, BS, "parent"),
        ("mamba", 4 * BS, BS, "anchor"),
        ("mamba", 4 * BS, BS, "anchor"),
    ]
    assert [g.get("snapshot_interval") for g in meta["groups"]] == [None, 4 * BS, 4 * BS]


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


def drive(groups, num_blocks, seed, check_view, snapshot_every=0, check_snapshot=None):
    """A scheduler loop; before each step `check_view(view, scheduler)` gets the event-fed view.

    Every `snapshot_every` steps the view is rebuilt from a snapshot (after
    `check_snapshot(live view, snapshot events)` when given) and follows the
    stream from there.
    """
    m, sink = make(num_blocks, groups=groups)
    view = EngineView.from_metadata(kv_events_metadata(m))
    stream = Stream()
    sched = Scheduler(m, SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=4))
    runner = ModelFreeRunner(sampled_vocab=3)
    rng = random.Random(seed)
    pending = sorted(random_requests(rng, 40), key=lambda r: r[0])
    step = 0
    while pending or sched.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, prompt, max_tokens = pending.pop(0)
            sched.add_request(
                Request(
                    f"r{step}-{len(pending)}", prompt, params=SamplingParams(max_tokens=max_tokens)
                )
            )
        events = sink.take()
        stream.apply(events)
        view.apply(KVEventBatch(0.0, events))
        if snapshot_every and step % snapshot_every == 0:
            snapshot = snapshot_events(m)
            if check_snapshot is not None:
                check_snapshot(view, snapshot)
            view.clear()
            view.apply(KVEventBatch(0.0, snapshot))
        check_view(view, sched)
        out = sched.schedule()
        finished = sched.update(out, execute(runner, out, m))
        for req in finished:
            runner.free_request(req.request_id)
        step += 1
    stream.apply(sink.take())
    assert stream.removed == m.pool.num_evictions
    return m


def predictions_match(counter):
    def check(view, sched):
        for req in sched.waiting:
            m = sched.manager
            seq = m.sequence(req.request_id)
            m.hasher.extend(seq.block_hashes, seq.token_ids, seq.extra_keys)
            hashes = [wire_hash(h) for h in seq.block_hashes]
            hit = m.get_computed_blocks(req.request_id, 0)
            assert not hit.wait  # between steps every block is computed
            assert view.hit_tokens(hashes, len(req.token_ids)) == hit.num_tokens, req.request_id
            counter["compared"] += 1
            counter["hits"] += bool(hit.num_tokens)

    return check


def usable(view: EngineView) -> set[tuple[int, object]]:
    """(group, hash) of every entry whose verification link still holds in `view`."""
    out: set[tuple[int, object]] = set()
    chained = [g for g in (view.anchor, *view.chained) if g is not None]
    for g in chained:
        by_gen = {gen: link for gen, link in view.groups[g].values()}
        ok: dict[int, bool] = {}

        def good(gen: int, by_gen=by_gen, ok=ok) -> bool:
            if gen not in ok:
                link = by_gen[gen]
                ok[gen] = link == ROOT or (link in by_gen and good(link))
            return ok[gen]

        out |= {(g, h) for h, (gen, _) in view.groups[g].items() if good(gen)}
    for g, group in enumerate(view.groups):
        if g in chained:
            continue
        for h, (_, link) in group.items():
            a = view.groups[view.anchor].get(h)  # type: ignore[index]
            if a is not None and a[0] == link and (view.anchor, h) in out:
                out.add((g, h))
    return out


def snapshot_is_usable_part(live: EngineView, snapshot) -> None:
    """The snapshot holds exactly what the live view can still use: nothing stale, nothing lost."""
    rebuilt = EngineView.from_metadata(live.metadata)
    rebuilt.apply(KVEventBatch(0.0, snapshot))
    held = {(g, h) for g, group in enumerate(rebuilt.groups) for h in group}
    assert held == usable(live) == usable(rebuilt)


LAYOUTS = [
    ("full",),
    ("full", "sliding:5"),
    ("full", "sliding:9", "sliding:14"),
    ("full", "full"),
    ("full", "mamba:4", "mamba:4"),
    ("full", "full", "mamba:2"),
]


@pytest.mark.parametrize("groups", LAYOUTS)
@pytest.mark.parametrize("seed", range(6))
def test_event_fed_view_predicts_every_hit_under_eviction(groups, seed):
    counter = {"compared": 0, "hits": 0}
    m = drive(groups, 16 * len(groups), seed, predictions_match(counter))
    assert counter["hits"] > 0 and m.pool.num_evictions > 0


@pytest.mark.parametrize("groups", LAYOUTS[1:])
@pytest.mark.parametrize("seed", range(3))
def test_snapshot_rebuilds_the_exact_view(groups, seed):
    counter = {"compared": 0, "hits": 0}
    drive(
        groups,
        16 * len(groups),
        seed,
        predictions_match(counter),
        snapshot_every=3,
        check_snapshot=snapshot_is_usable_part,
    )
    assert counter["hits"] > 0


def evict_all_but(m, keep) -> None:
    """Evict every free block except `keep` (held meanwhile): what an LRU pool may well do."""
    pool = m.pool
    pool.touch(keep)
    pool.release(pool.take(pool.num_free))
    pool.release(keep)


def test_snapshot_leaves_out_what_no_hit_can_use():
    """An entry whose parent is gone, snapshots whose anchor is gone or stale: left out."""
    m, sink = make(16, groups=("full", "mamba:4"))
    live = EngineView.from_metadata(kv_events_metadata(m))
    a = CacheSequence("a", list(range(21)))  # hash blocks 0-3 fill block X1, 4 starts X2
    prefill(m, a)
    m.free(a.request_id)
    h = [wire_hash(x) for x in a.block_hashes]
    entries, pages = m.pool.index[0], m.pool.index[1]
    assert set(pages) == {a.block_hashes[3], a.block_hashes[4]}  # after tokens 16 and 20
    # X1 goes (hash blocks 0-3); X2 (hash block 4) and both snapshots stay.
    evict_all_but(m, [entries[a.block_hashes[4]].block, *pages.values()])
    live.apply(KVEventBatch(0.0, sink.take()))
    assert set(live.groups[0]) == {h[4]} and set(live.groups[1]) == {h[3], h[4]}
    snapshot = snapshot_events(m)
    stored = {(e.group_idx, x) for e in snapshot[1:] for x in e.block_hashes}
    # Block 4's parent is gone, the snapshot after block 3 lost its anchor, the one after
    # block 4 is anchored to block 4: no hit can use any of them.
    assert stored == usable(live) == set()
    # Hash blocks 0-3 come back (new registrations): block 4 and its snapshot stay stale.
    b = CacheSequence("b", list(range(17)))
    assert prefill(m, b).num_tokens == 0
    m.free(b.request_id)
    live.apply(KVEventBatch(0.0, sink.take()))
    rebuilt = EngineView.from_metadata(live.metadata)
    rebuilt.apply(KVEventBatch(0.0, snapshot_events(m)))
    held = {(g, x) for g, group in enumerate(rebuilt.groups) for x in group}
    assert held == usable(live) and (0, h[4]) not in held and (1, h[4]) not in held
    assert {(0, x) for x in h[:4]} <= held
    for n in (17, 21, 22, 25):
        seq = CacheSequence("probe", list(range(n)))
        seq = add_seq(m, seq)
        expected = m.get_computed_blocks(seq.request_id).num_tokens
        hashes = [wire_hash(x) for x in seq.block_hashes]
        assert live.hit_tokens(hashes, n) == rebuilt.hit_tokens(hashes, n) == expected, n


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
