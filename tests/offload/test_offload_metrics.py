"""The offload tiers' dropped writes in /metrics: a disk that refuses every block is seen.

A cache that silently stores nothing looks healthy; the count of writes that did not
land, by tier medium, is what an operator alerts on.
"""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvserve.serve.http.metrics import CacheConfigInfo, EngineSnapshot, ServerMetrics
from tests.offload.test_tier_failures import unwritable_directory
from tests.serve.conftest import metric, scrape, start_server, stop_server

NAME = "offload_dropped_writes"


def families(metrics: ServerMetrics) -> dict[str, list]:
    text = metrics.render().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_the_series_is_exported_by_medium_only_with_tiers():
    cache = CacheConfigInfo(4, 4, 10, "sha256", True)
    metrics = ServerMetrics("kvserve", "m", cache)
    assert f"kvserve:{NAME}" not in families(metrics)  # no tiers: no series
    metrics.snapshot = EngineSnapshot(dropped_writes=(("CPU", 0), ("STORAGE", 7)))
    samples = families(metrics)[f"kvserve:{NAME}"]
    by_medium = {s.labels["medium"]: s.value for s in samples if s.name.endswith("_total")}
    assert by_medium == {"CPU": 0, "STORAGE": 7}
    assert all(s.labels["model_name"] == "m" for s in samples)


def test_a_disk_tier_that_refuses_writes_shows_its_drops_in_metrics(tmp_path):
    from kvserve.model.demo import ensure_demo_model

    demo = ensure_demo_model(tmp_path / "demo")
    bad = unwritable_directory(tmp_path)
    server = start_server(demo, "--offload", f"cpu:1MiB,disk:{bad}:1MiB")
    try:
        series = f"kvserve:{NAME}_total"
        assert metric(scrape(server), series, medium="STORAGE") == 0
        deadline = time.monotonic() + 30
        drops = 0.0
        for i in range(100):  # the writer drops in the background: the next step publishes
            body = {"model": demo, "prompt": f"{i} blocks to a disk " * 4, "max_tokens": 2}
            resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert resp.status_code == 200, resp.text
            values = scrape(server)
            drops = metric(values, series, medium="STORAGE")
            if drops > 0 or time.monotonic() > deadline:
                break
        assert drops > 0
        assert metric(values, series, medium="CPU") == 0  # the CPU tier took every block
    finally:
        stop_server(server)
