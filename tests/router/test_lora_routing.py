"""Two replicas serving a LoRA adapter behind `kvserve route`: the router hashes an adapter
request's blocks with the adapter's content identity (from the replicas' /kv-metadata),
so every predicted hit is the hit the replica reports, for the adapter and the base alike
(the same conversations under each share no block)."""

from __future__ import annotations

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
