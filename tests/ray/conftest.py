"""A real local Ray cluster of two nodes on loopback (Ray's own test utilities), with kvserve
replicas deployed on it through Ray Serve: applications of `kvserve.ray:app`, each at its own
route prefix, all started at once. Ray is started once per test module and always shut
down, whatever the tests did."""

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
    """One application on Serve's proxy."""

    url: str
    """Its route on Serve's HTTP proxy."""
    model: str
    name: str
    args: dict[str, Any]
    """The builder's arguments it was deployed with."""

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
    """Two Ray nodes on loopback, Serve's proxy on the head only; three CPUs, two on the head:
    the places of three replicas that take one each (no Ray log monitor, no autoscaler)."""
    from ray.cluster_utils import Cluster

    node = {"object_store_memory": OBJECT_STORE_BYTES, "include_log_monitor": False}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={**node, "num_cpus": 2, "include_dashboard": False, "no_monitor": True},
    )
    try:
        # joins while Serve starts on the head
        cluster.add_node(wait=False, num_cpus=1, **node)
        ray.init(address=cluster.address, logging_level="warning", log_to_driver=False)
        yield cluster
    finally:  # the nodes' processes go with them (Serve's actors included)
        try:
            ray.shutdown()
        finally:
            cluster.shutdown()


def deploy(demo: str, apps: dict[str, dict[str, Any]]) -> dict[str, RayServe]:
    """`kvserve.ray:app` with each of these arguments, as the application of that name at
    `/name` on a fresh Serve proxy port, all deployed at once (their replicas start
    together); returns once the kvserve router follows every replica's events."""
    from ray import serve

    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    served = {
        name: RayServe(
            f"http://127.0.0.1:{port}/{name}", demo, name, {"model": demo, **ENGINE, **args}
        )
        for name, args in apps.items()
    }
    serve.run_many([_target(s) for s in served.values()])
    for s in served.values():
        _wait_followed(s)
    return served


def _target(served: RayServe) -> Any:
    from ray import serve

    from kvserve.ray import app

    return serve.RunTarget(app(served.args), name=served.name, route_prefix=f"/{served.name}")


def _wait_followed(served: RayServe) -> None:
    if served.args.get("request_router", "kvserve") == "kvserve":
        replicas = served.args["num_replicas"]
        wait_for(lambda: len(served.followed()) == replicas, 60, f"{replicas} replicas' KV events")
