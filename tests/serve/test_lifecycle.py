"""Load shedding and shutdown: a full queue is a 503, SIGTERM drains, events reach subscribers."""

from __future__ import annotations

import json
import re
import signal
import threading
import time

import httpx
import pytest

from kvserve.cli.common import LOOPBACK_EVENTS_ENDPOINT, loopback_events
from kvserve.events.subscriber import KVEventSubscriber
from tests._ports import free_port
from tests.serve.conftest import start_server, stop_server

LONG = {"prompt": "go on and on", "max_tokens": 2000, "ignore_eos": True, "stream": True}


def stream_in_background(url: str, body: dict, results: list, started: threading.Event) -> None:
    """One streaming request; appends (status, parsed events) when it ends."""
    events = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                started.set()
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
        results.append((resp.status_code, events))
    started.set()


def test_a_full_queue_answers_503_with_retry_after(demo):
    srv = start_server(
        demo, "--max-num-seqs", "1", "--max-queued-requests", "1", "--shutdown-timeout", "0"
    )
    results: list = []
    try:
        running = threading.Event()
        first = threading.Thread(
            target=stream_in_background, args=(srv.url, LONG, results, running)
        )
        first.start()
        assert running.wait(60)
        queued = threading.Event()
        body = {**LONG, "max_tokens": 2}
        second = threading.Thread(
            target=stream_in_background, args=(srv.url, body, results, queued)
        )
        second.start()  # waits behind the first: max_num_seqs 1
        time.sleep(0.5)
        resp = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert resp.status_code == 503, resp.text
        assert resp.headers["retry-after"] == "1"
        error = resp.json()["error"]
        assert "--max-queued-requests 1" in error["message"]
        assert error["type"] == "service_unavailable_error"
        assert not queued.is_set()
    finally:
        log = stop_server(srv)  # SIGTERM: the running one is aborted, the queued one refused
    first.join(30)
    second.join(30)
    assert sorted(status for status, _ in results) == [200, 503]
    assert "Traceback" not in log


@pytest.mark.slow
def test_sigterm_drains_aborts_flushes_events_and_exits_0(demo):
    port, replay = free_port(), free_port()
    events = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://127.0.0.1:{port}",
        "bind": True,
        "replay_endpoint": f"tcp://127.0.0.1:{replay}",
    }
    srv = start_server(demo, "--kv-events-config", json.dumps(events), "--shutdown-timeout", "1")
    sub = KVEventSubscriber(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}")
    results: list = []
    started = threading.Event()
    worker = threading.Thread(target=stream_in_background, args=(srv.url, LONG, results, started))
    short = {"prompt": "A prompt that fills some blocks of four tokens.", "max_tokens": 3}
    try:
        assert httpx.post(f"{srv.url}/v1/completions", json=short, timeout=60).status_code == 200
        worker.start()
        assert started.wait(60)
        srv.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # draining: new work is refused, health says so
            try:
                health = httpx.get(f"{srv.url}/health", timeout=1)
            except httpx.HTTPError:
                pytest.fail("the server closed before its drain time was over")
            if health.status_code == 503:
                break
            time.sleep(0.05)
        assert health.status_code == 503
        refused = httpx.post(f"{srv.url}/v1/completions", json=short, timeout=5)
        assert refused.status_code == 503 and "shutting down" in refused.text
        assert srv.proc.wait(30) == 0
        worker.join(30)
        while sub.poll(0.2):
            pass
    finally:
        log = stop_server(srv)
        sub.close()
    assert "Traceback" not in log
    [(status, chunks)] = results
    assert status == 200 and chunks[-1] == "[DONE]"
    assert chunks[-2]["choices"][0]["finish_reason"] == "abort"
    last = re.search(r"the last batch \(seq (\d+)\) is sent", log)
    assert last, log[-2000:]
    assert sub.last_seq == int(last.group(1)) > 0


def test_requests_that_finish_in_time_are_not_aborted(demo):
    srv = start_server(demo, "--shutdown-timeout", "60")
    results: list = []
    started = threading.Event()
    body = {**LONG, "max_tokens": 40}
    worker = threading.Thread(target=stream_in_background, args=(srv.url, body, results, started))
    try:
        worker.start()
        assert started.wait(60)
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(60) == 0
        worker.join(30)
    finally:
        log = stop_server(srv)
    [(status, chunks)] = results
    assert status == 200 and chunks[-2]["choices"][0]["finish_reason"] == "length"
    text_chunks = [c for c in chunks[:-1] if c["choices"]]
    assert "aborting" not in log and "Traceback" not in log
    assert len(text_chunks) >= 1
    frozen = re.search(r"start-up heap frozen: (\d+) objects skipped", log)
    assert frozen and int(frozen.group(1)) > 10_000, log[-2000:]


def test_event_sockets_bind_loopback_unless_the_config_says_otherwise():
    on = '{"enable_kv_cache_events": true}'
    assert json.loads(loopback_events(on)) == {
        "enable_kv_cache_events": True,
        "endpoint": LOOPBACK_EVENTS_ENDPOINT,
        "bind": True,
    }
    assert LOOPBACK_EVENTS_ENDPOINT.startswith("tcp://127.0.0.1:")
    explicit = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000"}'
    assert loopback_events(explicit) == explicit
    assert loopback_events(None) is None
