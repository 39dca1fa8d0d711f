"""Which replica gets a request: round-robin, least-loaded, or cache-aware.

A policy only decides. The caller knows, per replica, the prefix hit it
would report for the request (`hits`, exact: `kvserve.events.index.PrefixIndex.match`
over that replica's event-fed view) and its load (`ReplicaLoad`, kept by the
caller from what it sent and what came back). Everything is plain numbers,
so the same policy serves `kvserve simulate --replicas` and a live router.

cache-aware (the default) counts both sides in one unit, prompt tokens still
to be computed:

    cost(i) = (num_tokens - hit(i)) + queued_prefill_tokens(i)

the prefill this request would compute on replica i, plus the prefill queued
there ahead of it. The cheapest healthy replica wins (ties: fewer running,
then the lower index). So a hit wins exactly when it saves more tokens than
the queue in front of it costs; with no hit anywhere (a cold or cleared
index) the rule is least-loaded.

Guard: a request that hits costs little prefill but still takes a seat and
memory, so a hot prefix would pile every request on the replica that holds
it. A replica running more than `GUARD_RATIO` x the fewest running plus
`GUARD_SLACK` is not chosen for its hit: its hit counts as 0, and the request
goes where load says (which then caches the prefix too).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

POLICIES = ("round-robin", "least-loaded", "cache-aware")

GUARD_RATIO = 1.5
GUARD_SLACK = 4
"""A replica with running > GUARD_RATIO * min(running) + GUARD_SLACK is too busy
to be chosen for its hit (see the module docstring)."""


@dataclass(slots=True, frozen=True)
class ReplicaLoad:
    """One replica's load as the caller knows it when a request arrives."""

    running: int
    """Requests the replica is working on (sent and not finished)."""
    queued_prefill_tokens: int
    """Prompt tokens sent to it whose prefill has not been computed yet (the caller's
    estimate: prompt minus predicted hit, until the request's first token)."""
    healthy: bool = True
    """False: never chosen."""


@dataclass(slots=True, frozen=True)
class Choice:
    replica: int
    """Index into the lists given to `choose`."""
    predicted_hit_tokens: int
    """hits[replica]: the prefix-cache hit the chosen replica should report."""


class Policy(Protocol):
    name: str

    def choose(self, num_tokens: int, hits: Sequence[int], loads: Sequence[ReplicaLoad]) -> Choice:
        """The replica for a request of `num_tokens` prompt tokens; ValueError if none
        is healthy. `hits[i]`: prefix hit tokens replica i would report at admission."""
        ...


def _healthy(hits: Sequence[int], loads: Sequence[ReplicaLoad]) -> list[int]:
    if len(hits) != len(loads):
        raise ValueError(f"{len(hits)} hits for {len(loads)} replicas")
    healthy = [i for i, load in enumerate(loads) if load.healthy]
    if not healthy:
        raise ValueError(f"no healthy replica among {len(loads)}")
    return healthy


class RoundRobin:
    """Healthy replicas in turn, whatever they hold."""

    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, num_tokens: int, hits: Sequence[int], loads: Sequence[ReplicaLoad]) -> Choice:
        healthy = _healthy(hits, loads)
        replica = next((i for i in healthy if i >= self._next), healthy[0])
        self._next = replica + 1
        return Choice(replica, hits[replica])


class LeastLoaded:
    """Fewest queued prefill tokens, then fewest running, then the lower index."""

    name = "least-loaded"

    def choose(self, num_tokens: int, hits: Sequence[int], loads: Sequence[ReplicaLoad]) -> Choice:
        healthy = _healthy(hits, loads)
        replica = min(healthy, key=lambda i: (loads[i].queued_prefill_tokens, loads[i].running, i))
        return Choice(replica, hits[replica])


class CacheAware:
    """Least prefill to compute, queue included; a hit on a crowded replica counts 0."""

    name = "cache-aware"

    def choose(self, num_tokens: int, hits: Sequence[int], loads: Sequence[ReplicaLoad]) -> Choice:
        healthy = _healthy(hits, loads)
        bound = GUARD_RATIO * min(loads[i].running for i in healthy) + GUARD_SLACK

        def cost(i: int) -> tuple[int, int, int]:
            load = loads[i]
            hit = hits[i] if load.running <= bound else 0
            return (num_tokens - hit + load.queued_prefill_tokens, load.running, i)

        replica = min(healthy, key=cost)
        return Choice(replica, hits[replica])


def make_policy(name: str) -> Policy:
    """A fresh policy by name; ValueError naming the policy and the choices."""
    if name == "round-robin":
        return RoundRobin()
    if name == "least-loaded":
        return LeastLoaded()
    if name == "cache-aware":
        return CacheAware()
    raise ValueError(f"unknown routing policy {name!r}: choose one of {', '.join(POLICIES)}")
