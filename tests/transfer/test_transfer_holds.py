"""A producer keeps each request's blocks until a consumer has pulled them, or
`hold_seconds` pass (kvserve.offload.cpu_tier): memory pressure evicts the blocks already
pulled first, a pull or the deadline ends a hold, and the tier ends keeping nothing.
Real engines on loopback; the consumer's greedy tokens equal a lone engine's throughout.
(test_transfer_faults.py: pressure past the kept blocks, the oldest hold giving way.)"""

from __future__ import annotations

import time

import pytest

from kvserve import LLM
from tests.transfer._engines import (
    BS,
    PROMPTS,
    RUN,
    assert_no_leak,
    consumer_engine,
    endpoint,
    kept,
    producer_engine,
    run,
    stored_per_prompt,
)


def wait_kept_none(producer: LLM, within: float) -> None:
    deadline = time.monotonic() + within
    while kept(producer)["blocks"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert kept(producer)["blocks"] == 0


@pytest.mark.parametrize("hold", [30, 0])
def test_kept_blocks_outlive_pressure_until_pulled(checkpoints, hold):
    """Room for two prompts: P0 and P1 prefilled, P1 pulled, P2 prefilled. Kept, P0's
    blocks outlive P2's pressure (P1's, pulled, go instead); with hold_seconds 0 (plain
    LRU) P0's, the least recently used, are evicted and recomputed."""
    ck = checkpoints["llama"]
    room = 2 * stored_per_prompt(ck)
    producer = producer_engine(ck, f"cpu:{room}", hold_seconds=hold)
    consumer = consumer_engine(ck, endpoint(producer))
    p0, p1, p2 = PROMPTS[:3]
    try:
        run(producer, [p0], 1)
        run(producer, [p1], 1)
        assert kept(producer)["blocks"] == (2 * RUN if hold else 0)
        assert run(consumer, [p1]) == [ck.reference(p1, 4)]
        assert kept(producer) == (
            {"blocks": RUN, "released_by_pull": RUN, "released_by_deadline": 0,
             "released_by_pressure": 0} if hold else
            {"blocks": 0, "released_by_pull": 0, "released_by_deadline": 0,
             "released_by_pressure": 0}
        )  # fmt: skip
        run(producer, [p2], 1)  # evicts a prompt's worth
        pulled = consumer.stats()["external_hit_tokens"]
        assert run(consumer, [p0, p2]) == [ck.reference(p, 4) for p in (p0, p2)]
        got = consumer.stats()["external_hit_tokens"] - pulled
        assert got == (2 * RUN * BS if hold else RUN * BS)  # without: P0's run recomputed
        if hold:
            ended = {"blocks": 0, "released_by_pull": 3 * RUN, "released_by_deadline": 0,
                     "released_by_pressure": 0}  # fmt: skip
            assert kept(producer) == ended
        assert_no_leak(producer, consumer)
    finally:
        consumer.shutdown()
        producer.shutdown()


def test_the_deadline_releases_what_no_consumer_pulled(checkpoints):
    ck = checkpoints["llama"]
    producer = producer_engine(ck, hold_seconds=0.5)
    consumer = consumer_engine(ck, endpoint(producer))
    try:
        run(producer, PROMPTS[:2], 1)
        assert kept(producer)["blocks"] == 2 * RUN
        assert run(consumer, PROMPTS[:1]) == [ck.reference(PROMPTS[0], 4)]  # P1: not pulled
        wait_kept_none(producer, 10)
        counts = kept(producer)
        assert counts["released_by_pull"] == RUN and counts["released_by_deadline"] == RUN
        # Released, not dropped: what the deadline released is still there to pull.
        assert run(consumer, PROMPTS[1:2]) == [ck.reference(PROMPTS[1], 4)]
        assert consumer.stats()["external_hit_tokens"] == 2 * RUN * BS
        assert_no_leak(producer, consumer)
    finally:
        consumer.shutdown()
        producer.shutdown()
