"""Real `kvserve serve` replicas with KV events, and `kvserve route` in front of them."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from kvserve.model.demo import ensure_demo_model
from tests._ports import free_port
from tests.serve.conftest import (
    Server,
    metric,
    scrape,
    start_command,
    start_server,
    stop_server,
    wait_healthy,
)

BLOCKS = "1024"
"""Room for every test's conversations: nothing is evicted, so every hit is predictable."""


@pytest.fixture(scope="session")
def demo(tmp_path_factory) -> str:
    return ensure_demo_model(tmp_path_factory.mktemp("router-demo"))


def events_config(endpoint: int, replay: int) -> str:
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "endpoint": f"tcp://127.0.0.1:{endpoint}",
            "bind": True,  # a host without `*` would connect (vLLM's rule)
            "replay_endpoint": f"tcp://127.0.0.1:{replay}",
        }
    )


def start_replica(
    demo: str, ports: tuple[int, int] | None = None, extra: tuple[str, ...] = (), **kw
) -> Server:
    """A replica publishing its events (with replay) on `ports`, free ones by default;
    `extra`: more `kvserve serve` options."""
    endpoint, replay = ports or (free_port(), free_port())
    config = events_config(endpoint, replay)
    options = ("--kv-events-config", config, "--num-kv-blocks", BLOCKS, *extra)
    return start_server(demo, *options, **kw)


def start_replicas(demo: str, n: int) -> list[Server]:
    """n replicas started side by side (each start costs seconds)."""
    return [wait_healthy(s) for s in [start_replica(demo, wait=False) for _ in range(n)]]


def start_split_replicas(demo: str, decoders: int = 1) -> list[Server]:
    """A prefill engine (a producer with a CPU tier) and `decoders` decode engines reading
    its blocks, started side by side and not yet waited for (the prefill engine first)."""
    port = free_port()
    producer = {"kv_role": "kv_producer", "kv_port": port}
    consumer = {"kv_role": "kv_consumer",
                "kv_connector_extra_config": {"peers": [f"tcp://127.0.0.1:{port}"]}}  # fmt: skip
    return [
        start_replica(demo, extra=("--offload", "cpu:64MiB", "--kv-transfer-config",
                                   json.dumps(producer)), wait=False),
        *[start_replica(demo, extra=("--kv-transfer-config", json.dumps(consumer)), wait=False)
          for _ in range(decoders)],
    ]  # fmt: skip


def start_router(replicas: list, *extra: str) -> Server:
    """`kvserve route` over the replicas (anything with a `url`); its model: theirs."""
    args = ["route", *[a for r in replicas for a in ("--replica", r.url)], *extra]
    return start_command(args, next((r.model for r in replicas if hasattr(r, "model")), ""))


def stop_all(*servers: Server | None) -> list[str]:
    """Stop them side by side (each drains); what each printed."""
    running = [s for s in servers if s is not None]
    for s in running:
        if s.proc.poll() is None:
            s.proc.terminate()
    return [stop_server(s) for s in running]


def router_value(router: Server, name: str, replica: Server | str) -> float:
    url = replica if isinstance(replica, str) else replica.url
    return metric(scrape(router), f"kvserve:router_{name}", replica=url)


def router_series(router: Server) -> dict[str, float]:
    """The router's series (for a failing assertion's message)."""
    return {k: v for k, v in scrape(router).items() if "_created" not in k}


def router_total(router: Server, name: str) -> float:
    values = scrape(router)
    return sum(v for k, v in values.items() if k.startswith(f"kvserve:router_{name}{{"))


def wait_for(check, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def get(url: str) -> httpx.Response:
    return httpx.get(url, timeout=10)


@pytest.fixture(scope="module")
def pair(demo):
    """One replica and a router in front of it: (replica, router)."""
    (replica,) = start_replicas(demo, 1)
    router = start_router([replica])
    yield replica, router
    stop_all(router, replica)
