"""`kvserve serve --data-parallel-size 2 --lora-modules ...`: both ranks serve the adapters,
the router in front hashes adapter requests with their content identity (every predicted
hit is the hit the rank reports), and a load or unload through the one port reaches every
rank; a bad adapter is a 400 and nothing changes (kvserve.router.adapters)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests._ports import free_ports
from tests.lora.conftest import make_adapter
from tests.lora.test_lora_cli import _Base
from tests.router._workload import conversations
from tests.router.conftest import BLOCKS, router_series, router_total, stop_all
from tests.serve.conftest import scrape, start_server

pytestmark = pytest.mark.slow


def listed(url: str) -> set[str]:
    return {m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}


def test_adapters_on_every_rank_routed_exactly_and_loaded_through_the_port(demo, tmp_path):
    first = make_adapter(_Base(demo), tmp_path / "first", seed=11)
    later = make_adapter(_Base(demo), tmp_path / "later", seed=12)
    base = free_ports(4)
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{base}", "bind": True}
    srv = start_server(
        demo, "--data-parallel-size", "2", "--num-kv-blocks", BLOCKS,
        "--kv-events-config", json.dumps(events), "--lora-modules", f"first={first.path}",
    )  # fmt: skip
    try:
        ranks = sorted({k.split("replica=")[1].rstrip("}") for k in scrape(srv) if "replica=" in k})
        assert len(ranks) == 2
        assert all("first" in listed(url) for url in ranks)
        tuned = conversations(srv.url, "first", "dp-lora", n=2, turns=2)
        plain = conversations(srv.url, srv.model, "dp-lora", n=2, turns=2)  # the same salts
        assert sum(tuned) > 0 and plain[:2] == [0, 0]  # the adapter's blocks are its own

        load = {"lora_name": "later", "lora_path": later.path}
        answer = httpx.post(f"{srv.url}/v1/load_lora_adapter", json=load, timeout=60)
        assert answer.status_code == 200, answer.text
        assert all("later" in listed(url) for url in ranks)
        assert sum(conversations(srv.url, "later", "dp-lora", n=2, turns=2)) > 0
        exact = router_total(srv, "prediction_exact_total")
        assert exact == 12 and router_total(srv, "prediction_wrong_total") == 0, router_series(srv)

        bad = {"lora_name": "bad", "lora_path": str(tmp_path / "missing")}
        answer = httpx.post(f"{srv.url}/v1/load_lora_adapter", json=bad, timeout=60)
        assert answer.status_code == 400 and "not a directory" in answer.json()["error"]["message"]
        assert all("bad" not in listed(url) for url in ranks)

        answer = httpx.post(f"{srv.url}/v1/unload_lora_adapter", json={"lora_name": "later"})
        assert answer.status_code == 200, answer.text
        assert all("later" not in listed(url) for url in ranks)
        with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0) as c:
            with pytest.raises(openai.NotFoundError):
                c.completions.create(model="later", prompt="Hello", max_tokens=2)
            out = c.completions.create(model="first", prompt="Hello", max_tokens=2)
            assert out.model == "first"
    finally:
        log = stop_all(srv)[0]
    assert "Traceback" not in log
