"""The ZMQ transport: replay after a gap, resync after a restart, a slow subscriber, config."""

from __future__ import annotations

import time

import pytest
import zmq
from _cache_seqs import add_seq

from kvserve.events import KVEventsConfig, KVEventSubscriber, make_engine_events
from kvserve.events.config import offset_endpoint_port
from kvserve.events.publisher import should_bind
from kvserve.kvcache import CacheSequence, KVCacheConfig, KVCacheManager
from kvserve.kvcache.event_sink import KVEventSink
from kvserve.kvcache.events import KVEventBatch, encode_batch
from kvserve.kvcache.specs import inflate_for_state, spec_from_name

BS = 4


class Engine:
    """A KV manager with events; `step(prompt)` prefills one request under the events lock."""

    def __init__(self, config: dict, num_blocks: int = 24, groups=("full", "sliding:6")) -> None:
        self.manager = KVCacheManager(
            KVCacheConfig(
                num_blocks=num_blocks,
                block_size=BS,
                specs=inflate_for_state([spec_from_name(g, BS) for g in groups]),
            )
        )
        self.events = make_engine_events(self.manager, config)
        assert self.events is not None
        self.n = 0

    def step(self, prompt: list[int]) -> int | None:
        with self.events.lock:
            self.n += 1
            seq = CacheSequence(f"r{self.n}", prompt)
            m = self.manager
            seq = add_seq(m, seq)
            hit = m.get_computed_blocks(seq.request_id)
            assert not hit.wait  # one request per step: nothing it reads is pending
            assert m.allocate_slots(
                seq.request_id, len(prompt) - hit.num_tokens, hit.num_tokens, hit
            )
            m.end_step()
            m.free(seq.request_id)
            return self.events.end_step()

    def hit(self, prompt: list[int]) -> int:
        seq = CacheSequence("probe", list(prompt))
        seq = add_seq(self.manager, seq)
        return self.manager.get_computed_blocks(seq.request_id).num_tokens

    @property
    def last_seq(self) -> int:
        return self.events.publisher.last_seq

    def close(self) -> None:
        self.events.close()


PROMPTS = [[i % 3] * 5 + list(range(i, i + 9)) for i in range(12)] + [[0] * 20, [1] * 13]


def assert_predicts(engine: Engine, sub: KVEventSubscriber, prompts=PROMPTS) -> int:
    """Every prompt's predicted hit is the engine's; returns how many hit at all."""
    hits = 0
    for prompt in prompts:
        expected = engine.hit(prompt)
        assert sub.index.match(prompt)[sub.engine] == expected, prompt
        hits += bool(expected)
    return hits


@pytest.fixture
def engine(ports):
    e = Engine(ports.config(buffer_steps=4))
    yield e
    e.close()


def test_fresh_subscriber_follows_then_replays_a_deliberate_gap(ports, engine):
    sub = KVEventSubscriber(ports.connect, ports.replay_connect)
    try:
        time.sleep(0.2)  # let the SUB connection settle (PUB drops before it)
        engine.step(PROMPTS[0])
        sub.wait_for(engine.last_seq)
        engine.step(PROMPTS[1])
        engine.step(PROMPTS[2])
        # Lose batch 1 on purpose: the subscriber must notice at batch 2 and replay it.
        assert sub._sub.poll(2000)
        _topic, seq, _payload = sub._sub.recv_multipart()
        assert int.from_bytes(seq, "big") == 1
        sub.wait_for(engine.last_seq)
        assert sub.gaps == 1 and sub.last_seq == 2
        assert sub.resyncs <= 1  # the initial sync may have used a snapshot
        assert_predicts(engine, sub)
    finally:
        sub.close()


def test_restarted_subscriber_resyncs_beyond_the_replay_buffer(ports, engine):
    for prompt in PROMPTS:  # evictions included: 24 blocks, 2 groups
        engine.step(prompt)
    assert engine.manager.pool.num_evictions > 0
    assert engine.last_seq >= 4  # more than the replay buffer holds
    sub = KVEventSubscriber(ports.connect, ports.replay_connect)
    try:
        assert sub.resyncs == 1 and sub.last_seq == engine.last_seq
        assert_predicts(engine, sub)
        engine.step(PROMPTS[3] + [7, 7, 7, 7])
        sub.wait_for(engine.last_seq)
        assert_predicts(engine, sub)
    finally:
        sub.close()
    # A new subscriber within the replay buffer's reach replays instead.
    second = KVEventSubscriber(ports.connect, ports.replay_connect)
    try:
        assert second.resyncs == 1 and second.last_seq == engine.last_seq
        assert_predicts(engine, second)
    finally:
        second.close()


STEM = [(5 * i) % 11 for i in range(40)]
STATE_PROMPTS = [[*STEM[:n], 50 + n % 3] for n in (9, 14, 21, 30, 5, 17, 33, 12, 26, 38, 3)]
STATE_PROBES = [p[:n] for p in STATE_PROMPTS for n in range(1, len(p) + 1, 3)] + STATE_PROMPTS


def test_state_model_resync_rebuilds_the_exact_view(ports):
    """Mamba hybrid (attention blocks of 4 hash blocks): live, replay and snapshot views agree."""
    engine = Engine(
        ports.config(buffer_steps=3), num_blocks=20, groups=("full", "mamba:4", "mamba:4")
    )
    live = KVEventSubscriber(ports.connect, ports.replay_connect)
    try:
        for prompt in STATE_PROMPTS:
            engine.step(prompt)
            live.wait_for(engine.last_seq)
            assert_predicts(engine, live, STATE_PROBES)
        assert engine.manager.pool.num_evictions > 0 and engine.last_seq >= 4
        late = KVEventSubscriber(ports.connect, ports.replay_connect)
        try:
            assert late.resyncs == 1 and late.last_seq == engine.last_seq
            assert assert_predicts(engine, late, STATE_PROBES) > 0
            kinds = {g["kind"] for g in late.view.metadata["groups"]}
            assert kinds == {"full_attention", "mamba"}
            # The snapshot holds what a hit can use: at most what the live view holds.
            assert 0 < late.view.num_blocks <= live.view.num_blocks
            for prompt in STATE_PROMPTS[:4]:
                engine.step([*prompt, 7, 7, 7, 7, 7])
            late.wait_for(engine.last_seq)
            live.wait_for(engine.last_seq)
            assert assert_predicts(engine, late, STATE_PROBES) > 0
            assert_predicts(engine, live, STATE_PROBES)
        finally:
            late.close()
    finally:
        live.close()
        engine.close()


def test_replay_from_batch_zero_needs_no_snapshot(ports):
    engine = Engine(ports.config())
    try:
        for prompt in PROMPTS[:3]:
            engine.step(prompt)
        sub = KVEventSubscriber(ports.connect, ports.replay_connect)
        assert sub.resyncs == 0 and sub.replays == 1 and sub.last_seq == engine.last_seq
        assert_predicts(engine, sub)
        sub.close()
    finally:
        engine.close()


def test_slow_subscriber_never_slows_the_engine(ports):
    engine = Engine(ports.config(max_queue_size=4, buffer_steps=1000))
    sub = KVEventSubscriber(ports.connect, ports.replay_connect)
    publisher = engine.events.publisher
    try:
        publisher._send = lambda seq, payload: time.sleep(0.05)  # a sender stuck on the network
        worst = 0.0
        for i in range(60):
            t0 = time.perf_counter()
            engine.step(PROMPTS[i % len(PROMPTS)] + [i])
            worst = max(worst, time.perf_counter() - t0)
        assert worst < 0.02, f"a step took {worst * 1e3:.1f} ms with a full queue"
        assert publisher.dropped >= 60 - 4 - 2 and publisher.last_seq == 59
        del publisher._send  # the network recovers
        engine.step([5] * 9)
        sub.wait_for(engine.last_seq)  # the tail was dropped too: found by asking, then resync
        assert sub.resyncs >= 2
        assert_predicts(engine, sub)
    finally:
        sub.close()
        engine.close()


def test_config_forms_and_endpoint_rules():
    as_dict = {"enable_kv_cache_events": True, "endpoint": "tcp://*:6000", "topic": "kv"}
    a = KVEventsConfig.from_any(as_dict)
    b = KVEventsConfig.from_any(
        '{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000", "topic": "kv"}'
    )
    assert a == b and a.publisher == "zmq" and a.active
    assert KVEventsConfig.from_any(a) is a
    assert not KVEventsConfig.from_any(None).active
    assert KVEventsConfig.from_any({"enable_kv_cache_events": False}).publisher == "null"
    with pytest.raises(ValueError, match="unknown keys"):
        KVEventsConfig.from_any({"enable_kv_cache_events": True, "endpont": "x"})
    with pytest.raises(ValueError, match="publisher"):
        KVEventsConfig(enable_kv_cache_events=True, publisher="kafka")
    assert should_bind("tcp://*:5557") and not should_bind("tcp://10.0.0.1:5557")
    assert offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint_port("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"


def test_data_parallel_rank_offsets_ports_and_annotates_batches(ports):
    config = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://*:{ports.pub - 1}",
        "replay_endpoint": f"tcp://127.0.0.1:{ports.replay - 1}",
        "data_parallel_rank": 1,
    }
    try:
        engine = Engine(config)
    except OSError:
        pytest.skip("port below the free one is taken")
    seen = []
    sub = KVEventSubscriber(
        ports.connect, ports.replay_connect, on_batch=lambda s, b: seen.append(b)
    )
    try:
        engine.step(PROMPTS[0])
        sub.wait_for(engine.last_seq)
        assert seen and all(b.data_parallel_rank == 1 for b in seen)
    finally:
        sub.close()
        engine.close()


def test_bind_failure_is_a_clear_os_error(ports):
    engine = Engine(ports.config())
    try:
        with pytest.raises(OSError, match="cannot open"):
            Engine(ports.config())
    finally:
        engine.close()


def test_publisher_keeps_its_topic_frame(ports):
    engine = Engine(ports.config(topic="engine-a"))
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.SUB)
    raw.setsockopt(zmq.SUBSCRIBE, b"engine-a")
    raw.connect(ports.connect)
    try:
        time.sleep(0.2)
        engine.step(PROMPTS[0])
        assert raw.poll(3000)
        topic, seq, payload = raw.recv_multipart()
        assert topic == b"engine-a" and len(seq) == 8 and payload
    finally:
        raw.close(linger=0)
        engine.close()


def test_engine_restart_is_detected_and_a_late_copy_of_batch_zero_is_not(ports):
    first = Engine(ports.config())
    sub = KVEventSubscriber(ports.connect, ports.replay_connect)
    try:
        time.sleep(0.2)
        for prompt in PROMPTS[:3]:
            first.step(prompt)
        sub.wait_for(first.last_seq)
        sub.catch_up()  # replays batch 0 again: a copy, not a restart
        assert sub.restarts == 0 and sub.last_seq == first.last_seq
        # A restarted engine's first batch (seq 0, a new ts) on the live socket.
        other = KVCacheManager(KVCacheConfig(num_blocks=24, block_size=BS))
        sink = KVEventSink(BS)
        other.attach_events(sink)
        seq = CacheSequence("x", PROMPTS[6])
        seq = add_seq(other, seq)
        assert other.allocate_slots(seq.request_id, len(PROMPTS[6]), 0)
        sub._on_message(0, encode_batch(KVEventBatch(time.time() + 1, sink.take())))
        assert sub.restarts == 1 and sub.last_seq == 0
        assert sub.view.num_blocks == len(PROMPTS[6]) // BS
    finally:
        sub.close()
        first.close()


def test_any_free_port_is_reported_as_the_port_bound():
    """`tcp://HOST:*` binds ports ZMQ picks (a Ray replica's default, several to a node);
    the endpoints reported are the real ones, and a subscriber follows through them."""
    config = {
        "enable_kv_cache_events": True,
        "endpoint": "tcp://127.0.0.1:*",
        "replay_endpoint": "tcp://127.0.0.1:*",
        "bind": True,
        "data_parallel_rank": 2,  # no offset for a port not yet known
    }
    engines = [Engine(config), Engine(config)]
    publishers = [e.events.publisher for e in engines]
    try:
        endpoints = {p.endpoint for p in publishers} | {p.replay_endpoint for p in publishers}
        assert len(endpoints) == 4 and not any(e.endswith(":*") for e in endpoints)
        sub = KVEventSubscriber(publishers[1].endpoint, publishers[1].replay_endpoint)
        try:
            engines[1].step(PROMPTS[0])
            sub.wait_for(engines[1].last_seq)
            assert assert_predicts(engines[1], sub) > 0
        finally:
            sub.close()
    finally:
        for e in engines:
            e.close()
