"""Two replicas serving a LoRA adapter behind `kvserve route`: the router hashes an adapter
request's blocks with the adapter's content identity (from the replicas' /kv-metadata),
so every predicted hit is the hit the replica reports, for the adapter and the base alike
(the same conversations under each share no block)."""

from __future__ import annotations

import httpx
import pytest

from tests.lora.conftest import make_adapter
from tests.lora.test_lora_cli import _Base
from tests.router._workload import conversations
from tests.router.conftest import (
    router_series,
    router_total,
    start_replica,
    start_router,
    stop_all,
    wait_healthy,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(demo, tmp_path_factory):
    adapter = make_adapter(_Base(demo), tmp_path_factory.mktemp("route-lora") / "a", seed=9)
    lora = ("--lora-modules", f"tuned={adapter.path}")
    started = [start_replica(demo, extra=lora, wait=False) for _ in range(2)]
    replicas = [wait_healthy(s) for s in started]
    router = None
    try:
        router = start_router(replicas)
        yield replicas, router
    finally:
        stop_all(router, *replicas)


def test_adapter_requests_hit_as_predicted(cluster):
    _, router = cluster
    tuned = conversations(router.url, "tuned", "lora", n=2, turns=2)
    base = conversations(router.url, router.model, "lora", n=2, turns=2)  # the same salts
    assert sum(tuned) > 0  # the second turns hit their first turns' blocks
    assert base[:2] == [0, 0]  # the adapter's blocks are not the base model's
    total = len(tuned) + len(base)
    assert router_total(router, "prediction_exact_total") == total, router_series(router)
    assert router_total(router, "prediction_wrong_total") == 0


def test_adapters_loaded_through_the_router_on_replicas_that_differ(demo, tmp_path):
    """One replica serves `tuned`, the other takes ranks up to 8 only: `tuned`'s requests go
    only to the first (none is a 404 from the second); a rank-16 adapter loads on the first,
    fails on the second, and is undone on the first (a 400 naming the limit); a rank-4 one
    loads on both and is predicted exactly at once."""
    made = {n: make_adapter(_Base(demo), tmp_path / n, seed=s, rank=r)
            for n, s, r in (("tuned", 9, 4), ("big", 10, 16), ("small", 11, 4))}  # fmt: skip
    started = [
        start_replica(demo, extra=("--lora-modules", f"tuned={made['tuned'].path}"), wait=False),
        start_replica(demo, extra=("--enable-lora", "--max-lora-rank", "8"), wait=False),
    ]
    replicas = [wait_healthy(s) for s in started]
    router = None
    try:
        router = start_router(replicas)
        assert len(conversations(router.url, "tuned", "mixed", n=4, turns=2)) == 8

        def listed(name: str) -> list[bool]:
            return [
                name in {m["id"] for m in httpx.get(f"{r.url}/v1/models").json()["data"]}
                for r in replicas
            ]

        big = {"lora_name": "big", "lora_path": made["big"].path}
        answer = httpx.post(f"{router.url}/v1/load_lora_adapter", json=big, timeout=60)
        assert answer.status_code == 400 and "max_lora_rank" in answer.json()["error"]["message"]
        assert listed("big") == [False, False]
        small = {"lora_name": "small", "lora_path": made["small"].path}
        answer = httpx.post(f"{router.url}/v1/load_lora_adapter", json=small, timeout=60)
        assert answer.status_code == 200 and listed("small") == [True, True]
        exact = router_total(router, "prediction_exact_total")
        assert sum(conversations(router.url, "small", "mixed", n=2, turns=2)) > 0
        assert router_total(router, "prediction_exact_total") == exact + 4
        assert router_total(router, "prediction_wrong_total") == 0, router_series(router)
    finally:
        stop_all(router, *replicas)
