"""The routing policy API: `make_policy(name).choose(num_tokens, hits, loads) -> Choice`.

A minimal implementation of the agreed API (round-robin, least-loaded and a
simple cache-aware policy): the most predicted hit tokens among healthy
replicas, ties and zero hits to the least loaded one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

POLICIES = ("round-robin", "least-loaded", "cache-aware")


@dataclass(slots=True, frozen=True)
class ReplicaLoad:
    """One replica's load as the caller knows it when a request arrives."""

    running: int
    """Requests the replica is working on (sent and not finished)."""
    queued_prefill_tokens: int
    """Prompt tokens sent to it whose prefill has not been computed yet (an estimate)."""
    healthy: bool = True
    """False: never chosen."""


@dataclass(slots=True, frozen=True)
class Choice:
    replica: int
    """Index into the lists given to choose()."""
    predicted_hit_tokens: int
    """hits[replica]: the prefix-cache hit the chosen replica should report."""


class Policy(Protocol):
    name: str

    def choose(
        self, num_tokens: int, hits: Sequence[int], loads: Sequence[ReplicaLoad]
    ) -> Choice: ...


def _healthy(loads: Sequence[ReplicaLoad]) -> list[int]:
    healthy = [i for i, load in enumerate(loads) if load.healthy]
    if not healthy:
        raise ValueError("no healthy replica")
    return healthy


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, num_tokens: int, hits: Sequence[int], loads: Sequence[ReplicaLoad]) -> Choice:
        healthy = _healthy(loads)
        pick = next((i for i in healthy if i >= self._next), healthy[0])
        self._next = pick + 1
        return Choice(pick, hits[pick])


class LeastLoaded:
    """Fewest running requests, then fewest queued prefill tokens; ties rotate."""

    name = "least-loaded"

    def __init__(self) -> None:
        self._turn = 0

    def pick(self, candidates: list[int], loads: Sequence[ReplicaLoad]) -> int:
        def key(i: int) -> tuple[int, int]:
            return (loads[i].running, loads[i].queued_prefill_tokens)

        best = min(key(i) for i in candidates)
        tied = [i for i in candidates if key(i) == best]
        self._turn += 1
        return tied[self._turn % len(tied)]

    def choose(self, num_tokens: int, hits: Sequence[int], loads: Sequence[ReplicaLoad]) -> Choice:
        pick = self.pick(_healthy(loads), loads)
        return Choice(pick, hits[pick])


class CacheAware:
    """Most predicted hit tokens; ties (and no hit anywhere) go to the least loaded."""

    name = "cache-aware"

    def __init__(self) -> None:
        self._least = LeastLoaded()

    def choose(self, num_tokens: int, hits: Sequence[int], loads: Sequence[ReplicaLoad]) -> Choice:
        healthy = _healthy(loads)
        best = max(hits[i] for i in healthy)
        pick = self._least.pick([i for i in healthy if hits[i] == best], loads)
        return Choice(pick, hits[pick])


def make_policy(name: str) -> Policy:
    if name == "round-robin":
        return RoundRobin()
    if name == "least-loaded":
        return LeastLoaded()
    if name == "cache-aware":
        return CacheAware()
    raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
