"""From the user's `offload` string to a TierStack."""

from __future__ import annotations

from kvserve.offload.cpu_tier import CpuTier
from kvserve.offload.disk_tier import DiskTier
from kvserve.offload.options import TierOptions, format_size, parse_offload
from kvserve.offload.store import TierStack
from kvserve.offload.tiers import Tier


def build_store(
    text: str | None,
    fingerprint: bytes,
    block_bytes: int = 0,
    key_bytes: int = 0,
    extra: list[Tier] | None = None,
    hold_seconds: float = 0.0,
) -> TierStack:
    """ "cpu:8GiB,disk:/dir:50GiB" (either alone) -> the tiers, fastest first.

    A tier that cannot hold one block (`block_bytes` of payload under a `key_bytes` key:
    the largest the engine stores) is refused here, naming it: it would store nothing,
    while looking like a cache. So is a disk path that cannot be a tier's directory.
    `extra` tiers go last (a KV transfer producer's, read through the network).
    `hold_seconds` > 0: the CPU tier keeps what it stores until pulled (a KV transfer
    producer's: kvserve.offload.cpu_tier).
    """
    tiers: list[Tier] = []
    for option in parse_offload(text) if text else []:
        kind = CpuTier if option.kind == "cpu" else DiskTier
        need = kind.stored_size(key_bytes, block_bytes)
        if need > option.capacity:
            raise _refuse(
                option,
                f"{format_size(option.capacity)} cannot hold one KV block, which takes "
                f"{format_size(need)} here; give the tier at least that",
            )
        if option.kind == "cpu":
            tiers.append(CpuTier(option.capacity, hold_seconds))
            continue
        assert option.path is not None  # TierOptions: a disk tier names its directory
        try:
            tiers.append(DiskTier(option.path, option.capacity, fingerprint))
        except ValueError as exc:
            raise _refuse(option, str(exc)) from None
    return TierStack([*tiers, *(extra or [])])


def _refuse(option: TierOptions, reason: str) -> ValueError:
    return ValueError(f"offload tier {option.text or option.kind!r}: {reason}")
