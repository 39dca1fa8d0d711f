"""A consumer's producers as one read-only tier: those its config names, and those it is
told of while it runs.

`kvserve serve` names its producers once (`peers`); on Ray Serve (kvserve.ray) the prefill
replicas come and go, and a restarted one serves on another port, so the decode replica is
told, with each request, the producer that just ran its prompt (`tell`). Each producer is a
RemoteTier (remote_tier.py); the one just told of, then the one that answered the last hit,
are asked first, since a prompt's blocks sit together on the producer that computed them.
A block no producer holds costs one ask of each, so only the producers told of in the last
TOLD_SECONDS are kept (the prefill replicas at work), at most MAX_TOLD (each holds one
socket); one whose ask failed (gone, slow) is dropped until it is told of again.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

from kvserve.transfer.remote_tier import ReadOnlyTier, RemoteTier

MAX_TOLD = 64
"""Producers told of at run time kept at once (the least recently told go first)."""
TOLD_SECONDS = 60.0
"""How long a producer told of is asked after it was last told of."""
COUNTERS = ("blocks_received", "bytes_received", "rejected", "asks", "failures", "seconds")


class Producers(ReadOnlyTier):
    """Read-only, like each of its RemoteTiers; the counters add up theirs (dropped ones
    included)."""

    def __init__(
        self, peers: tuple[str, ...], fingerprint: bytes, timeout_s: float, largest_payload: int
    ) -> None:
        self.fingerprint = fingerprint
        self.timeout_s = timeout_s
        self.largest_payload = largest_payload
        """The largest block the consumer stores: a producer's larger frame is refused."""
        self._fixed = [self._tier(p) for p in peers]
        self._told: OrderedDict[str, RemoteTier] = OrderedDict()
        """Least recently told first."""
        self._told_at: dict[str, float] = {}
        self._last: RemoteTier | None = None
        self._lock = threading.Lock()
        self._gone = dict.fromkeys(COUNTERS, 0.0)
        """The counters of the producers dropped."""

    def tell(self, endpoint: str) -> None:
        """A producer that holds blocks a coming request will look up (thread-safe)."""
        if not endpoint.startswith("tcp://"):
            raise ValueError(f"a producer is tcp://host:port, got {endpoint!r}")
        with self._lock:
            if any(t.endpoint == endpoint for t in self._fixed):
                return
            tier = self._told.pop(endpoint, None)
            tier = tier or self._tier(endpoint)
            self._told[endpoint] = tier
            self._told_at[endpoint] = time.monotonic()
            self._last = tier  # the coming request's blocks are there
            while len(self._told) > MAX_TOLD:
                self._drop(next(iter(self._told)))

    def _tier(self, endpoint: str) -> RemoteTier:
        return RemoteTier(endpoint, self.fingerprint, self.timeout_s, self.largest_payload)

    @property
    def tiers(self) -> list[RemoteTier]:
        """The producers asked now, each with its own counters."""
        with self._lock:
            return [*self._fixed, *self._told.values()]

    @property
    def endpoints(self) -> list[str]:
        with self._lock:
            return [t.endpoint for t in self._fixed] + list(self._told)

    def _drop(self, endpoint: str) -> None:
        """The lock held."""
        tier = self._told.pop(endpoint)
        del self._told_at[endpoint]
        for name in COUNTERS:
            self._gone[name] += getattr(tier, name)
        if self._last is tier:
            self._last = None
        tier.close()

    def _order(self) -> list[RemoteTier]:
        with self._lock:
            stale = time.monotonic() - TOLD_SECONDS
            for endpoint in [e for e, at in self._told_at.items() if at < stale]:
                self._drop(endpoint)
            tiers = [*self._fixed, *reversed(self._told.values())]  # the last told first
            last = self._last
        if last is not None and last in tiers:
            tiers.remove(last)
            tiers.insert(0, last)
        return tiers

    def _asked(self, tier: RemoteTier, failures: int, hit: bool) -> None:
        with self._lock:
            if hit:
                self._last = tier
            elif tier.failures > failures and self._told.get(tier.endpoint) is tier:
                self._drop(tier.endpoint)  # gone: not asked again until told of again

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return [bool(x) for x in self._many("contains_many", keys)]

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Each key's verified payload or None; each producer asked once (in batches: one
        round trip each) for the keys the ones before it lacked."""
        return [x if isinstance(x, bytes) else None for x in self._many("get_many", keys)]

    def _many(self, op: str, keys: Sequence[bytes]) -> list[bytes | bool | None]:
        out: list[bytes | bool | None] = [None] * len(keys)
        missing = list(range(len(keys)))
        for tier in self._order():
            if not missing:
                break
            failures = tier.failures
            found = getattr(tier, op)([keys[i] for i in missing])
            for i, value in zip(missing, found, strict=True):
                out[i] = value
            self._asked(tier, failures, any(found))
            missing = [i for i in missing if not out[i]]
        return out

    def counts(self) -> dict[str, float]:
        """Each counter summed over the producers, present and dropped."""
        with self._lock:
            tiers = [*self._fixed, *self._told.values()]
            totals = dict(self._gone)
        for tier in tiers:
            for name in COUNTERS:
                totals[name] += getattr(tier, name)
        return totals

    def close(self) -> None:
        with self._lock:
            tiers = [*self._fixed, *self._told.values()]
        for tier in tiers:
            tier.close()
