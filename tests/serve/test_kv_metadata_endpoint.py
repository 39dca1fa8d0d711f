"""GET /kv-metadata: the engine's hashing as its event publisher reports it, behind the key."""

from __future__ import annotations

import json

import httpx

from kvserve.events.subscriber import KVEventSubscriber
from tests._ports import free_ports
from tests.serve.conftest import ENGINE, start_server, stop_server


def test_kv_metadata_is_the_publishers_plus_where_the_events_are(demo):
    base = free_ports(4)  # rank 1 binds each port + 1: base + 1 and base + 3
    port, replay = base, base + 2
    events = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://127.0.0.1:{port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay}",
        "topic": "kv@replica",
        "data_parallel_rank": 1,
    }
    srv = start_server(
        demo, "--kv-events-config", json.dumps(events), "--served-model-name", "tiny",
        env={"KVSERVE_API_KEY": "k"},
    )  # fmt: skip
    try:
        assert httpx.get(f"{srv.url}/kv-metadata").status_code == 401
        resp = httpx.get(f"{srv.url}/kv-metadata", headers={"Authorization": "Bearer k"})
        assert resp.status_code == 200
        body = resp.json()
        # Ports offset by the rank, as the publisher binds them.
        pub, rep = f"tcp://127.0.0.1:{port + 1}", f"tcp://127.0.0.1:{replay + 1}"
        assert body["kv_events"] == {
            "endpoint": pub,
            "replay_endpoint": rep,
            "topic": "kv@replica",
            "data_parallel_rank": 1,
        }
        assert body["model"] == demo and body["served_model_name"] == "tiny"
        assert body["enable_prefix_caching"] is True and body["pooling"] == "last"
        sub = KVEventSubscriber(pub, rep, topic="kv@replica", sync=False)
        try:
            assert body["kv_metadata"] == sub.fetch_metadata()
        finally:
            sub.close()
        assert body["kv_metadata"]["hash_block_size"] == ENGINE["block_size"]
    finally:
        stop_server(srv)


def test_kv_metadata_without_events(server):
    body = httpx.get(f"{server.url}/kv-metadata").json()
    assert body["kv_events"] is None
    meta = body["kv_metadata"]
    assert meta["hash_block_size"] == ENGINE["block_size"] and meta["groups"]
    assert meta["enable_prefix_caching"] is body["enable_prefix_caching"] is True
