"""A real local Ray cluster of two nodes on loopback (Ray's own test utilities), with kvserve
replicas deployed on it through Ray Serve. Ray is started once per test module and always
shut down, whatever the tests did."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from kvserve.model.demo import ensure_demo_model
from tests._ports import free_port
from tests.serve.conftest import metric, scrape

ray = pytest.importorskip("ray")

OBJECT_STORE_BYTES = 80 * 2**20
"""Ray's object store per node: kvserve sends it nothing large."""
ENGINE = {"num_kv_blocks": 1024, "num_threads": 1}
"""Room for every conversation (nothing evicted: every hit is predictable); one thread each."""


@dataclass(slots=True)
class RayServe:
    url: str
    """Serve's HTTP proxy."""
    model: str

    def total(self, name: str) -> float:
        values = scrape(self)
        return sum(v for k, v in values.items() if k.startswith(f"kvserve:router_{name}{{"))

    def value(self, name: str, replica: str) -> float:
        return metric(scrape(self), f"kvserve:router_{name}", replica=replica)

    def followed(self) -> set[str]:
        """The replicas whose KV events the router follows."""
        prefix = "kvserve:router_events_followed{replica="
        values = scrape(self)
        return {
            k.removeprefix(prefix)[:-1] for k, v in values.items() if k.startswith(prefix) and v
        }


def wait_for(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.fixture(scope="session")
def demo(tmp_path_factory) -> str:
    return ensure_demo_model(tmp_path_factory.mktemp("ray-demo"))


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """Two Ray nodes (one CPU each) on loopback; Serve's proxy on the head only."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "object_store_memory": OBJECT_STORE_BYTES,
            "include_dashboard": False,
        },
    )
    try:
        # joins while Serve starts on the head (the second replica waits for it)
        cluster.add_node(wait=False, num_cpus=1, object_store_memory=OBJECT_STORE_BYTES)
        ray.init(address=cluster.address, logging_level="warning", log_to_driver=False)
        yield cluster
    finally:  # the nodes' processes go with them (Serve's actors included)
        try:
            ray.shutdown()
        finally:
            cluster.shutdown()


def deploy(cluster: Any, demo: str, name: str, **args: Any) -> RayServe:
    """`kvserve.ray:app` with these arguments as application `name` on a fresh Serve
    proxy port; returns once every replica's events are followed (kvserve's router)."""
    from ray import serve

    from kvserve.ray import app

    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    args = {
        "model": demo,
        "num_replicas": 2,
        "ray_actor_options": {"num_cpus": 1},
        **ENGINE,
        **args,
    }
    application = app(args)
    serve.run(application, name=name, route_prefix="/")
    served = RayServe(f"http://127.0.0.1:{port}", demo)
    if args.get("request_router", "kvserve") == "kvserve":
        replicas = args["num_replicas"]
        wait_for(lambda: len(served.followed()) == replicas, 30, "the replicas' KV events")
    return served
