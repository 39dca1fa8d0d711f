"""From the user's `offload` string to a TierStack."""

from __future__ import annotations

from kvserve.offload.cpu_tier import CpuTier
from kvserve.offload.disk_tier import DiskTier
from kvserve.offload.options import parse_offload
from kvserve.offload.store import TierStack
from kvserve.offload.tiers import Tier


def build_store(text: str, fingerprint: bytes) -> TierStack:
    """ "cpu:8GiB,disk:/dir:50GiB" (either alone) -> the tiers, fastest first."""
    tiers: list[Tier] = []
    for option in parse_offload(text):
        if option.kind == "cpu":
            tiers.append(CpuTier(option.capacity))
        else:
            tiers.append(DiskTier(option.path, option.capacity, fingerprint))  # type: ignore[arg-type]
    return TierStack(tiers)
