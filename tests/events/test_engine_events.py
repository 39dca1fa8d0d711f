"""Events from a real engine (a tiny checkpoint) and from the command line."""

from __future__ import annotations

import json
import threading
import time

from _stream_checks import StreamChecker

from kvserve import LLM, SamplingParams
from kvserve.cli import main
from kvserve.events import KVEventSubscriber
from kvserve.events.watch import watch


def test_llm_engine_events_predict_every_admission(checkpoints, ports):
    ck = checkpoints["qwen3"]
    llm = LLM(
        ck.path,
        block_size=4,
        num_kv_blocks=14,
        max_num_seqs=2,
        device="cpu",
        dtype="float32",
        num_threads=1,
        kv_events_config=ports.config(),
    )
    engine = llm.engine
    sub = KVEventSubscriber(ports.connect, ports.replay_connect)
    stem = [(7 * i) % 300 + 1 for i in range(22)]
    prompts = [[*stem[:n], n] for n in (21, 9, 16, 3, 21, 12)] + [stem, stem[:8]]
    params = SamplingParams(temperature=0, max_tokens=6)
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        compared = hits = 0
        while engine.has_unfinished_requests():
            if engine.kv_events.publisher.last_seq >= 0:
                sub.wait_for(engine.kv_events.publisher.last_seq)
            for req in engine.scheduler.waiting:
                expected = engine.manager.get_computed_blocks(req.request_id, 0).num_tokens
                assert sub.index.match(req.token_ids)[sub.engine] == expected, req.request_id
                compared += 1
                hits += bool(expected)
            engine.step()
        assert compared >= len(prompts) and hits >= 3
        assert engine.manager.pool.num_evictions > 0
        # Greedy tokens are unchanged by events (speed features never change tokens).
        out = llm.generate([stem], params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == ck.reference(stem, 6)
        assert llm.reset_prefix_cache()
        sub.wait_for(engine.kv_events.publisher.last_seq)
        assert sub.view.num_blocks == 0
    finally:
        sub.close()
        llm.shutdown()


def test_bamba_engine_events_predict_every_admission(bamba_checkpoint, ports):
    """A real hybrid (Mamba2 + attention, inflated blocks): stream rules and exact hits."""
    llm = LLM(
        bamba_checkpoint.path,
        block_size=4,
        num_kv_blocks=20,
        max_num_seqs=3,
        device="cpu",
        dtype="float32",
        num_threads=1,
        kv_events_config=ports.config(),
    )
    engine = llm.engine
    manager = engine.manager
    assert manager.groups[0].block_size > manager.block_size  # inflated attention blocks
    checker = StreamChecker(block_size=4)
    sub = KVEventSubscriber(ports.connect, ports.replay_connect, on_batch=checker)
    meta = sub.view.metadata
    assert meta["hit_rule"] == "state" and meta["hash_block_size"] == 4
    assert {g["kind"] for g in meta["groups"]} == {"full_attention", "mamba"}
    stem = [(7 * i) % 300 + 1 for i in range(40)]
    lengths = (9, 13, 9, 3, 22, 13, 38, 11, 22, 9, 30)
    prompts = [[*stem[:n], n % 5] for n in lengths] + [stem[:9], stem[:23]]
    params = SamplingParams(temperature=0, max_tokens=5)
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        compared = hits = 0
        while engine.has_unfinished_requests():
            if engine.kv_events.publisher.last_seq >= 0:
                sub.wait_for(engine.kv_events.publisher.last_seq)
            for req in engine.scheduler.waiting:
                expected = manager.get_computed_blocks(req.request_id, 0).num_tokens
                assert sub.index.match(req.token_ids)[sub.engine] == expected, req.request_id
                compared += 1
                hits += bool(expected)
            engine.step()
        sub.wait_for(engine.kv_events.publisher.last_seq)
        assert compared >= len(prompts) and hits >= 3
        assert manager.pool.num_evictions > 0 and checker.num_removed > 0
        assert checker.stored_by_kind["mamba"] > 0 and checker.stored_by_kind["full_attention"] > 0
    finally:
        sub.close()
        llm.shutdown()


def test_simulate_cli_publishes_and_events_cli_prints(ports, tmp_path, capsys):
    config = json.dumps(ports.config())
    lines: list[str] = []
    done = threading.Event()

    def follow() -> None:
        watch(ports.connect, ports.replay_connect, duration=3.0, out=lines.append)
        done.set()

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    time.sleep(0.3)  # the watcher waits for the engine's replay socket
    args = ["simulate", "--no-progress", "--workload", "identical-burst", "--num-requests", "3"]
    args += ["--prompt-len", "40", "--output-len", "4", "--max-num-seqs", "1"]
    args += ["--kv-events-config", config, "--kv-events-linger", "1.5"]
    assert main(args) == 0
    thread.join(timeout=10)
    assert done.is_set()
    text = "\n".join(lines)
    assert "stored  group 0 (full_attention)" in text
    assert "index:" in text and "following" in text


def test_events_cli_option_is_validated(capsys):
    assert main(["simulate", "--no-progress", "--kv-events-config", '{"endpont": 1}']) == 2
    assert "unknown keys" in capsys.readouterr().err
