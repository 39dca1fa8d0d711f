"""The routing policies on plain numbers: what each chooses, and what cache-aware trades."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvserve.routing import POLICIES, ReplicaLoad, make_policy
from kvserve.routing.policy import GUARD_RATIO, GUARD_SLACK

IDLE = ReplicaLoad(running=0, queued_prefill_tokens=0)


def idle(n: int) -> list[ReplicaLoad]:
    return [IDLE] * n


class Cluster:
    """Replicas as a router sees them: which prefixes each holds, and its load.

    Prefill is done before the next request arrives (nothing stays queued);
    requests run until `finish` is called, so piling shows in `running`.
    """

    def __init__(self, policy: str, replicas: int, prefix_len: int) -> None:
        self.policy = make_policy(policy)
        self.prefix_len = prefix_len
        self.holds: list[set[str]] = [set() for _ in range(replicas)]
        self.running = [0] * replicas
        self.computed = [0] * replicas

    def send(self, prefix: str, num_tokens: int) -> int:
        hits = [self.prefix_len if prefix in held else 0 for held in self.holds]
        loads = [ReplicaLoad(r, 0) for r in self.running]
        choice = self.policy.choose(num_tokens, hits, loads)
        assert choice.predicted_hit_tokens == hits[choice.replica]
        self.holds[choice.replica].add(prefix)
        self.running[choice.replica] += 1
        self.computed[choice.replica] += num_tokens - choice.predicted_hit_tokens
        return choice.replica


def test_make_policy_knows_every_name_and_refuses_others():
    assert [make_policy(name).name for name in POLICIES] == list(POLICIES)
    assert make_policy("cache-aware") is not make_policy("cache-aware")  # fresh state each
    with pytest.raises(ValueError, match=r"'cache_aware'.*round-robin, least-loaded, cache-aware"):
        make_policy("cache_aware")


@pytest.mark.parametrize("name", POLICIES)
def test_bad_inputs_are_errors(name):
    policy = make_policy(name)
    with pytest.raises(ValueError, match="no healthy replica among 2"):
        policy.choose(10, [0, 0], [ReplicaLoad(0, 0, healthy=False)] * 2)
    with pytest.raises(ValueError, match="3 hits for 2 replicas"):
        policy.choose(10, [0, 0, 0], idle(2))


@pytest.mark.parametrize("name", POLICIES)
def test_an_unhealthy_replica_is_never_chosen(name):
    policy = make_policy(name)
    loads = [ReplicaLoad(0, 0), ReplicaLoad(0, 0, healthy=False), ReplicaLoad(9, 900)]
    for _ in range(6):  # round-robin's turn comes to replica 1 and passes it
        choice = policy.choose(1000, [0, 999, 0], loads)
        assert choice.replica != 1


def test_round_robin_takes_turns_whatever_is_cached():
    policy = make_policy("round-robin")
    chosen = [policy.choose(100, [0, 99, 0], idle(3)).replica for _ in range(7)]
    assert chosen == [0, 1, 2, 0, 1, 2, 0]


def test_least_loaded_orders_by_queued_prefill_then_running():
    policy = make_policy("least-loaded")
    loads = [ReplicaLoad(1, 50), ReplicaLoad(9, 10), ReplicaLoad(2, 10)]
    assert policy.choose(100, [99, 0, 0], loads).replica == 2
    assert policy.choose(100, [0, 0, 0], idle(3)).replica == 0


def test_later_turns_go_to_the_replica_holding_the_history():
    policy = make_policy("cache-aware")
    # Replica 2 holds 900 of the 1000 tokens; a queue of 300 there costs less than 900.
    loads = [ReplicaLoad(0, 0), ReplicaLoad(1, 0), ReplicaLoad(3, 300)]
    choice = policy.choose(1000, [0, 0, 900], loads)
    assert (choice.replica, choice.predicted_hit_tokens) == (2, 900)
    # The same queue in front of a 200-token hit costs more than the hit saves.
    assert policy.choose(1000, [0, 0, 200], loads).replica == 0


def test_conversations_stay_where_their_history_is():
    cluster = Cluster("cache-aware", replicas=4, prefix_len=0)
    home = {}
    for turn in range(5):
        cluster.prefix_len = 100 * turn  # the history grows each turn
        for conv in range(8):
            replica = cluster.send(f"conv{conv}", 100 * (turn + 1))
            assert home.setdefault(conv, replica) == replica
        cluster.running = [0] * 4  # every turn finished before the next
    assert sorted(home.values()) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_two_hot_prefixes_spread_over_the_replicas():
    cluster = Cluster("cache-aware", replicas=4, prefix_len=2000)
    first = [cluster.send(p, 2100) for p in ("A", "B")]
    assert first[0] != first[1]
    for i in range(80):
        cluster.send("AB"[i % 2], 2100)
    assert min(cluster.running) > 0, "a replica was left idle"
    bound = GUARD_RATIO * min(cluster.running) + GUARD_SLACK + 1
    assert max(cluster.running) <= bound
    # Each prefix is computed on a few replicas, not once per request.
    assert sum(cluster.computed) < 6 * 2000 + 82 * 100


def test_without_the_guard_one_prefix_would_pile_on_one_replica():
    """What the guard prevents: the cost rule alone sends every hit to the holder."""
    cluster = Cluster("cache-aware", replicas=3, prefix_len=2000)
    for _ in range(GUARD_SLACK + 1):
        assert cluster.send("A", 2100) == 0  # within the guard: the hit wins
    assert cluster.running == [GUARD_SLACK + 1, 0, 0]
    # Now replica 0 runs more than GUARD_RATIO * 0 + GUARD_SLACK: its hit counts 0.
    assert cluster.send("A", 2100) == 1
    assert cluster.send("A", 2100) == 1  # replica 1 holds it now too, and is less busy


def test_the_guard_applies_only_to_the_crowded_replica():
    policy = make_policy("cache-aware")
    crowded = GUARD_SLACK + 1
    loads = [ReplicaLoad(crowded, 0), ReplicaLoad(0, 0), ReplicaLoad(1, 0)]
    assert policy.choose(1000, [900, 0, 500], loads).replica == 2
    loads[0] = ReplicaLoad(crowded - 1, 0)
    assert policy.choose(1000, [900, 0, 500], loads).replica == 0


loads_st = st.lists(
    st.builds(
        ReplicaLoad,
        running=st.integers(0, 50),
        queued_prefill_tokens=st.integers(0, 5000),
        healthy=st.booleans(),
    ),
    min_size=1,
    max_size=6,
).filter(lambda loads: any(load.healthy for load in loads))


@given(loads=loads_st, num_tokens=st.integers(1, 4000))
def test_an_empty_index_falls_back_to_load(loads, num_tokens):
    """No hit anywhere (a cold index, or a view a resync just cleared): least-loaded."""
    hits = [0] * len(loads)
    cache_aware = make_policy("cache-aware").choose(num_tokens, hits, loads)
    least_loaded = make_policy("least-loaded").choose(num_tokens, hits, loads)
    assert cache_aware == least_loaded
    assert cache_aware.predicted_hit_tokens == 0


@given(loads=loads_st, data=st.data())
def test_cache_aware_minimises_prefill_plus_queue_among_uncrowded(loads, data):
    num_tokens = data.draw(st.integers(1, 4000))
    hits = data.draw(
        st.lists(st.integers(0, num_tokens - 1), min_size=len(loads), max_size=len(loads))
    )
    choice = make_policy("cache-aware").choose(num_tokens, hits, loads)
    healthy = [i for i, load in enumerate(loads) if load.healthy]
    bound = GUARD_RATIO * min(loads[i].running for i in healthy) + GUARD_SLACK

    def cost(i):
        hit = hits[i] if loads[i].running <= bound else 0
        return num_tokens - hit + loads[i].queued_prefill_tokens

    assert choice.replica in healthy
    assert cost(choice.replica) == min(cost(i) for i in healthy)
    assert choice.predicted_hit_tokens == hits[choice.replica]
