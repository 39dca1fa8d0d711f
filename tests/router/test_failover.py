"""A replica killed in the middle of a workload: nothing is lost, and when it comes back
the router's view of it is rebuilt (its old blocks are gone) and exact again."""

from __future__ import annotations

import pytest

from tests._ports import free_port
from tests.router._workload import conversations
from tests.router.conftest import (
    router_series,
    router_total,
    router_value,
    start_replica,
    start_replicas,
    start_router,
    stop_all,
    wait_for,
)
from tests.serve.conftest import wait_healthy


@pytest.mark.slow
def test_a_killed_replica_loses_no_request_and_resyncs_when_restarted(demo):
    ports = (free_port(), free_port())
    first = start_replica(demo, ports, wait=False)
    (second,) = start_replicas(demo, 1)
    first = wait_healthy(first)
    router = back = None
    try:
        router = start_router([first, second], "--health-interval", "0.5")

        def kill_first(turn: int) -> None:
            if turn == 1:  # after each conversation's first answer, on either replica
                assert router_value(router, "view_blocks", first) > 0
                first.proc.kill()
                first.proc.wait()

        cached = conversations(router.url, router.model, "before", before_turn=kill_first)
        assert len(cached) == 12  # every request answered (the client never retries)
        assert router_total(router, "prediction_wrong_total") == 0
        assert router_value(router, "replica_healthy", first) == 0
        sent = router_value(router, "requests_total", first)
        predicted = router_value(router, "predicted_hit_tokens_total", first)

        port = int(first.url.rpartition(":")[2])
        back = start_replica(demo, ports, port=port)  # same address, same event ports
        wait_for(lambda: router_value(router, "events_followed", back) == 1, what="re-follow")
        # The view was rebuilt from the new engine: nothing of the killed one's cache is left.
        assert router_value(router, "view_blocks", back) == 0
        assert router_value(router, "replica_healthy", back) == 1

        conversations(router.url, router.model, "after", turns=2)
        assert router_value(router, "requests_total", back) > sent
        assert router_value(router, "predicted_hit_tokens_total", back) > predicted
        assert router_total(router, "prediction_wrong_total") == 0
        exact = router_total(router, "prediction_exact_total")
        assert exact == 12 + 8, router_series(router)
    finally:
        stop_all(router, back, second, first)
