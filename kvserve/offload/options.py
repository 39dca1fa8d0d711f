"""The user's `--offload` string: which external tiers, where, and how big.

Format: comma-separated parts, each `cpu:<size>` or `disk:<dir>:<size>`, at most one of
each, e.g. "cpu:8GiB,disk:/path/to/dir:50GiB". The size of a disk part is the text after
its last ':', so a directory may contain ':' (but not ','). Errors name the bad part: a
typo in a launch flag should say which word was wrong, not just "invalid".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from fractions import Fraction

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)
_SIZE_HELP = "a number with an optional unit B, KB, MB, GB, TB, KiB, MiB, GiB or TiB, e.g. 8GiB"
_TIER_HELP = "use cpu:<size> or disk:<dir>:<size>"


def parse_size(text: str) -> int:
    """Bytes in "8GiB", "1.5GB", "4096" (KB = 1000, KiB = 1024; units are case-insensitive).

    Decimal sizes are computed exactly (no float rounding) and rounded down to whole bytes.
    """
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"invalid size {text!r}: expected {_SIZE_HELP}")
    return int(Fraction(match.group(1)) * _UNITS[unit])


def format_size(size: int) -> str:
    """Bytes as a person reads them: "737,280 bytes (720.0 KiB)"."""
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if size >= scale:
            return f"{size:,} bytes ({size / scale:.1f} {unit})"
    return f"{size:,} bytes"


def size_bytes(value: int | str, name: str = "") -> int:
    """A positive size given as bytes (an int) or as text for `parse_size` ("2GiB").

    The one reader of sizes outside the offload string (`kv_cache_memory`, in Python and
    on the command line); errors name the option `name` (argparse names it itself).
    """
    prefix = f"{name}: " if name else ""
    if isinstance(value, str):
        try:
            size = parse_size(value)
        except ValueError as exc:
            raise ValueError(f"{prefix}{exc}") from None
    elif isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        raise ValueError(f"{prefix}expected bytes (an int) or a size such as '2GiB', got {value!r}")
    if size <= 0:
        raise ValueError(f"{prefix}the size must be positive, got {value!r}")
    return size


@dataclass(frozen=True, slots=True)
class TierOptions:
    """One external tier as the user asked for it: kind "cpu" or "disk", bytes, directory."""

    kind: str
    capacity: int
    path: str | None = None
    text: str = field(default="", compare=False)
    """The part of the offload string it came from (errors quote it)."""

    def __post_init__(self) -> None:
        if self.kind not in ("cpu", "disk"):
            raise ValueError(f"unknown tier kind {self.kind!r} ({_TIER_HELP})")
        if self.capacity <= 0:
            raise ValueError(f"{self.kind} tier capacity must be positive, got {self.capacity}")
        if self.kind == "disk" and not self.path:
            raise ValueError("a disk tier needs a directory")
        if self.kind == "cpu" and self.path is not None:
            raise ValueError("a cpu tier takes no path")


def parse_offload(text: str) -> list[TierOptions]:
    """Tiers from "cpu:8GiB,disk:/dir:50GiB", cpu first (the faster tier is asked first)."""
    if not text.strip():
        raise ValueError(f"empty offload spec {text!r} ({_TIER_HELP})")
    tiers: dict[str, TierOptions] = {}
    for raw in text.split(","):
        part = raw.strip()
        if not part:
            raise ValueError(f"offload spec {text!r}: empty part ({_TIER_HELP})")
        tier = _parse_part(part)
        if tier.kind in tiers:
            raise ValueError(
                f"offload part {part!r}: duplicate tier {tier.kind!r} (at most one of each)"
            )
        tiers[tier.kind] = tier
    return [tiers[kind] for kind in ("cpu", "disk") if kind in tiers]


def _parse_part(part: str) -> TierOptions:
    def fail(reason: str) -> ValueError:
        return ValueError(f"offload part {part!r}: {reason}")

    kind, sep, rest = part.partition(":")
    kind = kind.strip().lower()
    if kind not in ("cpu", "disk"):
        raise fail(f"unknown tier {kind!r} ({_TIER_HELP})")
    if not sep or not rest.strip():
        raise fail(f"missing size ({_TIER_HELP})")
    path: str | None = None
    if kind == "cpu":
        if ":" in rest:
            raise fail("the cpu tier takes only a size (cpu:<size>)")
        size_text = rest
    else:
        path, sep, size_text = rest.rpartition(":")
        if not sep:
            missing = "directory" if _is_size(rest) else "size"
            raise fail(f"missing {missing} (use disk:<dir>:<size>)")
        if not path.strip():
            raise fail("empty directory (use disk:<dir>:<size>)")
        if not size_text.strip():
            raise fail("missing size (use disk:<dir>:<size>)")
    try:
        capacity = parse_size(size_text)
    except ValueError:
        raise fail(f"bad size {size_text!r} (expected {_SIZE_HELP})") from None
    if capacity <= 0:
        raise fail("capacity must be positive")
    return TierOptions(kind, capacity, path, part)


def _is_size(text: str) -> bool:
    try:
        parse_size(text)
    except ValueError:
        return False
    return True
