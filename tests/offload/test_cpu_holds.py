"""A KV transfer producer's CPU tier keeps blocks until pulled (kvserve.offload.cpu_tier):
held blocks outlive pressure that evicts unheld ones, a pull or the deadline ends a hold,
and a tier full of held blocks gives way oldest hold first, never past its capacity."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.offload.cpu_tier import CpuTier

KB = b"x" * 10


def counts(tier: CpuTier) -> tuple[int, int, int, int]:
    c = tier.hold_counts()
    return (c["kept_blocks"], c["kept_released_by_pull"], c["kept_released_by_deadline"],
            c["kept_released_by_pressure"])  # fmt: skip


def test_held_blocks_outlive_pressure_that_evicts_unheld_ones():
    tier = CpuTier(40, hold_seconds=60)
    tier.put(b"held", KB)
    tier.hold([b"held"])
    for key in (b"a", b"b", b"c"):
        tier.put(key, KB)
    # The held block is the least recently used, yet the unheld ones go first.
    assert tier.put(b"d", KB) == [b"a"]
    assert tier.put(b"e", KB) == [b"b"]
    assert tier.contains(b"held") and counts(tier) == (1, 0, 0, 0)
    tier.release([b"held"])  # pulled: evictable again, as recently used
    assert counts(tier) == (0, 1, 0, 0)
    assert tier.put(b"f", KB) == [b"c"]
    assert tier.put(b"g", KB) == [b"d"]


def test_a_block_held_for_two_requests_needs_two_pulls():
    tier = CpuTier(20, hold_seconds=60)
    tier.put(b"prefix", KB)
    tier.hold([b"prefix"])
    tier.hold([b"prefix", b"absent"])  # a second request on the same prefix; absent: skipped
    tier.release([b"prefix"])
    tier.put(b"a", KB)
    assert tier.put(b"b", KB) == [b"a"]  # still held for the second request
    tier.release([b"prefix", b"never-held"])
    assert counts(tier) == (0, 1, 0, 0)
    assert tier.put(b"c", KB) == [b"b"] and tier.put(b"d", KB) == [b"prefix"]


def test_a_tier_full_of_held_blocks_releases_the_oldest_hold():
    tier = CpuTier(30, hold_seconds=60)
    for key in (b"1", b"2", b"3"):
        tier.put(key, KB)
        tier.hold([key])
    tier.hold([b"1"])  # held again later: now the newest hold
    assert tier.put(b"4", KB) == [b"2"]
    assert tier.used_bytes == 30 and counts(tier) == (2, 0, 0, 1)
    assert tier.keys() == [b"4", b"3", b"1"]


def test_the_deadline_ends_a_hold_and_its_block_goes_first():
    tier = CpuTier(30, hold_seconds=0.2)
    tier.put(b"old", KB)
    tier.put(b"late", KB)
    tier.hold([b"late"])
    tier.get(b"old")  # recently used, but unheld: still after an expired hold
    time.sleep(0.4)
    assert counts(tier) == (0, 0, 1, 0)
    tier.put(b"new", KB)
    assert tier.put(b"newer", KB) == [b"late"]  # nobody pulled it: evicted first


def test_no_hold_without_hold_seconds():
    tier = CpuTier(20)
    tier.put(b"a", KB)
    tier.hold([b"a"])
    tier.put(b"b", KB)
    assert tier.put(b"c", KB) == [b"a"] and counts(tier) == (0, 0, 0, 0)


OPS = st.lists(
    st.tuples(
        st.sampled_from(["put", "hold", "release", "get"]), st.integers(0, 7), st.integers(1, 12)
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(1, 40), ops=OPS)
def test_holds_never_overfill_the_tier_and_give_way_only_to_pressure(capacity, ops):
    """Whatever the puts, holds and pulls: the tier stays within its capacity, a held block
    is evicted only once no unheld block is left, and every hold ends counted."""
    tier = CpuTier(capacity, hold_seconds=60)
    held: dict[bytes, int] = {}
    for op, k, size in ops:
        key = bytes([k])
        if op == "put":
            unheld_before = set(tier.keys()) - set(held) - {key}
            evicted = tier.put(key, b"v" * size)
            if any(v in held for v in evicted):
                assert unheld_before <= set(evicted)  # the unheld went first
            for v in evicted:
                held.pop(v, None)
        elif op == "hold" and tier.contains(key):
            tier.hold([key])
            held[key] = held.get(key, 0) + 1
        elif op == "release":
            tier.release([key])
            if key in held:
                held[key] -= 1
                if not held[key]:
                    del held[key]
        else:
            tier.get(key)
        present = tier.keys()
        assert tier.used_bytes == sum(len(tier.get(x) or b"") for x in present) <= capacity
        assert counts(tier)[0] == len(held)
    tier.release([bytes([k]) for k in range(8) for _ in range(len(ops))])
    assert counts(tier)[0] == 0
