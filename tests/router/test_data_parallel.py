"""`kvserve serve --data-parallel-size 2`: two engines behind one port, stopped as one."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import httpx
import openai
import pytest

from kvserve.model.threads import default_num_threads
from tests._ports import free_ports
from tests.router._workload import conversations
from tests.router.conftest import (
    BLOCKS,
    router_series,
    router_total,
    stop_all,
)
from tests.serve.conftest import Server, scrape, start_server


@pytest.mark.slow
def test_two_ranks_behind_one_port_predict_exactly_and_stop_with_exit_0(demo):
    base = free_ports(4)  # PUB base, base + 1; replay base + 2, base + 3 (ranks offset by one)
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{base}", "bind": True}
    srv = start_server(
        demo, "--data-parallel-size", "2", "--num-kv-blocks", BLOCKS,
        "--kv-events-config", json.dumps(events), "--pooling", "mean",
    )  # fmt: skip
    try:
        ranks = sorted({k.split("replica=")[1].rstrip("}") for k in scrape(srv) if "replica=" in k})
        assert len(ranks) == 2 and srv.url not in ranks
        metadata = [httpx.get(f"{url}/kv-metadata", timeout=10).json() for url in ranks]
        assert sorted(m["kv_events"]["endpoint"] for m in metadata) == [
            f"tcp://127.0.0.1:{base}",
            f"tcp://127.0.0.1:{base + 1}",
        ]
        assert sorted(m["kv_events"]["replay_endpoint"] for m in metadata) == [
            f"tcp://127.0.0.1:{base + 2}",  # none was named: the event port + N
            f"tcp://127.0.0.1:{base + 3}",
        ]
        cached = conversations(srv.url, srv.model, "dp", n=2, turns=2)
        assert sum(cached) > 0
        assert router_total(srv, "prediction_exact_total") == 4, router_series(srv)
        assert router_total(srv, "prediction_wrong_total") == 0
        embeddings_behind_one_port(srv, ranks)
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(60) == 0
        for url in ranks:  # the children are gone with it
            try:
                httpx.get(f"{url}/health", timeout=2)
                raise AssertionError(f"{url} still answers")
            except httpx.ConnectError:
                pass
    finally:
        log = stop_all(srv)[0]
    assert "Traceback" not in log
    assert log.count("Serving ") == 2
    # Not told how many threads, each rank gets its share of the cores (at least one).
    assert log.count(f"CPU: {default_num_threads(2)} thread(s)") == 2, log


def embeddings_behind_one_port(srv: Server, ranks: list[str]) -> None:
    """The ranks pool by `mean` (--pooling reaches them): /v1/embeddings through the port
    equals a rank's own, and an input whose blocks a completion left is predicted no hit
    (a mean embedding reads none)."""
    texts = ["Mean pooling behind one port, every token's state averaged."] * 2
    body = {"prompt": texts[0], "max_tokens": 1}
    assert httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).status_code == 200
    with (
        openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", timeout=60) as routed,
        openai.OpenAI(base_url=f"{ranks[0]}/v1", api_key="unused", timeout=60) as rank,
    ):
        want = rank.embeddings.create(model=srv.model, input=texts)
        predicted = router_total(srv, "predicted_hit_tokens_total")
        got = routed.embeddings.create(model=srv.model, input=texts)
    for a, b in zip(got.data, want.data, strict=True):
        assert a.embedding == pytest.approx(b.embedding, abs=1e-5)
    assert router_total(srv, "predicted_hit_tokens_total") == predicted


def test_event_ports_that_would_meet_across_ranks_are_refused_with_one_line(demo):
    events = {
        "enable_kv_cache_events": True,
        "endpoint": "tcp://127.0.0.1:6000",
        "replay_endpoint": "tcp://127.0.0.1:6001",
    }
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--model", demo]
    cmd += ["--data-parallel-size", "2", "--kv-events-config", json.dumps(events)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "Traceback" not in done.stderr
    assert "overlap" in errors[0] and "tcp://127.0.0.1:6001" in errors[0]
