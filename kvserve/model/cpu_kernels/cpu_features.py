"""What this CPU can do for bfloat16: its model name and the few feature flags that decide
which dtype is fast on it (no torch needed, so the benchmarks' headers can say it too).

Without native bfloat16 instructions (AVX-512 BF16 or AMX; most laptops, AMD before Zen
4, Intel Xeons before Sapphire Rapids but Cooper Lake) a bfloat16 matmul is emulated
through float32 and runs several times slower than float32 itself, so `--dtype auto`
and the load log need to know (kvserve.model.device). Linux: /proc/cpuinfo's flags;
elsewhere torch's own checks.

`KVSERVE_CPU_FEATURES` overrides the flags (tests, or to see what kvserve would choose on
another CPU): names from FEATURES separated by spaces or commas, or `none`; e.g.
`KVSERVE_CPU_FEATURES=avx2` acts as an AVX2-only CPU. It changes kvserve's choices only,
not the instructions torch runs (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 do that)
nor the C kernels' (KVSERVE_KERNEL_CFLAGS=-mno-avx512f, kvserve.model.cpu_kernels.build).
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
from dataclasses import dataclass
from functools import cache

ENV = "KVSERVE_CPU_FEATURES"
FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_vnni", "avx_vnni", "bf16")
"""The flags kvserve reads, as /proc/cpuinfo spells them (`bf16`: aarch64's BF16
extension, BFDOT/BFMMLA)."""
NATIVE_BF16 = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
"""Any one of these runs bfloat16 matmuls in hardware."""
SHORT = {"amx_bf16": "amx"}
"""Shorter names in the log (`amx` is accepted in the override too)."""
CPUINFO = "/proc/cpuinfo"


@dataclass(frozen=True, slots=True)
class CpuFeatures:
    """The CPU's model name and which of FEATURES it has."""

    model: str
    flags: frozenset[str]
    source: str
    """Where the flags came from: /proc/cpuinfo, torch, or the override (ENV=...)."""

    @property
    def native_bf16(self) -> bool:
        return bool(self.flags & NATIVE_BF16)

    def names(self) -> str:
        """The flags found, in FEATURES' order ("avx2 avx512f avx512_bf16 amx"), or "none"."""
        found = [SHORT.get(f, f) for f in FEATURES if f in self.flags]
        return " ".join(found) or "none"

    def describe(self) -> str:
        """One phrase for a log line: model, flags, and whether bfloat16 is native."""
        bf16 = "native bfloat16" if self.native_bf16 else "no native bfloat16"
        override = f", {self.source}" if self.source.startswith(ENV) else ""
        return f"{self.model} ({self.names()}: {bf16}{override})"


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """The model name and FEATURES found in /proc/cpuinfo's text (its first processor)."""
    model, flags = "", frozenset[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model name", "cpu model") and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = frozenset(value.split()) & frozenset(FEATURES)
    return model, flags


def parse_override(value: str) -> frozenset[str]:
    """ENV's value as flags; a ValueError names an unknown one (a typo would silently
    act as a CPU without it)."""
    names = [n for n in re.split(r"[\s,]+", value.strip().lower()) if n and n != "none"]
    flags = {"amx_bf16" if n == "amx" else n for n in names}
    unknown = sorted(flags - set(FEATURES))
    if unknown:
        raise ValueError(
            f"{ENV}={value!r}: unknown feature(s) {', '.join(unknown)}; use any of "
            f"{', '.join(FEATURES)} (or amx), or none"
        )
    return frozenset(flags)


def detect() -> CpuFeatures:
    """This CPU's features, ENV's override applied (read again each call: tests set it)."""
    model, flags, source = _detected()
    override = os.environ.get(ENV)
    if override is not None:
        return CpuFeatures(model, parse_override(override), f"{ENV}={override}")
    return CpuFeatures(model, flags, source)


def cpuinfo_flags_line() -> str:
    """The real CPU's whole flags line (the C kernels' cache key: -march=native builds for
    the real CPU whatever ENV says); the machine's name where there is none."""
    try:
        with open(CPUINFO) as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


@cache
def _detected() -> tuple[str, frozenset[str], str]:
    """The real CPU, read once per process."""
    try:
        with open(CPUINFO) as f:
            model, flags = parse_cpuinfo(f.read())
        if flags:
            return model or _fallback_model(), flags, CPUINFO
    except OSError:
        pass
    return _fallback_model(), _torch_flags(), "torch"


def _fallback_model() -> str:
    return platform.processor() or platform.machine() or "unknown CPU"


def _torch_flags() -> frozenset[str]:
    """torch's own CPU checks, where there is no /proc/cpuinfo (macOS, Windows)."""
    try:
        import torch.cpu as tc
    except ImportError:
        return frozenset()
    checks = {
        "avx2": "_is_avx2_supported",
        "avx512f": "_is_avx512_supported",
        "avx512_bf16": "_is_avx512_bf16_supported",
        "amx_bf16": "_is_amx_tile_supported",
        "avx512_vnni": "_is_vnni_supported",
    }
    found = set()
    for flag, name in checks.items():
        check = getattr(tc, name, None)
        try:
            if check is not None and check():
                found.add(flag)
        except RuntimeError:
            continue
    if platform.system() == "Darwin" and _sysctl("hw.optional.arm.FEAT_BF16") == "1":
        found.add("bf16")  # Apple M2 and later; torch has no check for it
    return frozenset(found)


def _sysctl(name: str) -> str:
    try:
        done = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip()
