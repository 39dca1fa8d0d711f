"""Compile a kernel's C source once per machine and cache the shared library on disk.

torch ships no paged decode attention for the CPU, and its C++ extension
builder (`torch.utils.cpp_extension`) compiles against torch's headers for
tens of seconds; these kernels are plain C (no torch headers), so the system
C compiler builds one in well under a second, `-march=native` for the machine
it runs on. The library is cached under `~/.cache/kvserve/kernels` (or
`$KVSERVE_KERNEL_CACHE`), named by a hash of the source and the headers beside
it, the flags, the compiler's version and the CPU's feature flags, so a changed
kernel, compiler or machine builds again. Without a compiler `build` says why and returns None:
the callers keep torch's own ops.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.model.cpu_kernels.cpu_features import cpuinfo_flags_line

FLAGS = ("-O3", "-march=native", "-ffast-math", "-fno-reciprocal-math", "-fopenmp", "-fPIC") + (
    ("-mno-recip",) if platform.machine() in ("x86_64", "AMD64") else ()
)
"""Compile flags. -ffast-math lets exp vectorize (glibc's vector math) and the kernels never
rely on infinities or NaN in their own arithmetic; -fno-reciprocal-math and x86's
-mno-recip keep divisions and 1 / sqrt(x) exact (fast-math alone turns them into
approximate reciprocals, and the SiLU of 5.9375 then rounds to another bfloat16 than
torch's). -fopenmp: the OpenMP runtime torch loaded (libgomp.so.1, or Intel's libiomp5
preloaded) runs the kernels' threads."""

LINK = ("-shared", "-fopenmp")
"""Link flags: without -ffast-math, which would link gcc's crtfastmath.o into the library
and set flush-to-zero for the whole process when it loads (float32, whose exact mode
would lose its subnormals)."""


@dataclass(slots=True)
class Built:
    """A kernel's shared library, or why there is none."""

    path: Path | None
    seconds: float
    """Compile time; 0.0 when the cache had it."""
    reason: str = ""


def cache_dir() -> Path:
    base = os.environ.get("KVSERVE_KERNEL_CACHE")
    return Path(base) if base else Path.home() / ".cache" / "kvserve" / "kernels"


def build(source: Path, extra_flags: tuple[str, ...] = ()) -> Built:
    """The cached library of `source`, compiled now if the cache lacks it."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return Built(None, 0.0, "no C compiler (cc, or $CC) on PATH")
    flags = FLAGS + extra_flags
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    key = _key(source.read_bytes() + headers, compiler, flags + LINK)
    target = cache_dir() / f"{source.stem}-{key}.so"
    if target.exists():
        return Built(target, 0.0)
    target.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, out = Path(tmp) / "kernel.o", Path(tmp) / target.name
        for command in (
            [compiler, *flags, "-c", str(source), "-o", str(obj)],
            [compiler, *LINK, str(obj), "-o", str(out), "-lm"],
        ):
            failed = _run(command)
            if failed:
                return Built(None, 0.0, failed)
        os.replace(out, target)  # atomic: a concurrent build of the same key is harmless
    return Built(target, time.perf_counter() - start)


def _run(command: list[str]) -> str:
    """Run one compiler command; "" or why it failed."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{' '.join(command)}: {exc}"
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["no message"])[-1]
        return f"{command[0]} failed: {why}"
    return ""


def _key(source: bytes, compiler: str, flags: tuple[str, ...]) -> str:
    digest = hashlib.sha256(source)
    digest.update(" ".join(flags).encode())
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        version = compiler
    digest.update(version.encode())
    digest.update(cpuinfo_flags_line().encode())  # -march=native's target
    return digest.hexdigest()[:16]


AMX_ENV = "KVSERVE_AMX"
"""`0` keeps every kernel off AMX tiles on a CPU that has them (quant_matmul_amx.h,
prefill_attention_amx.h): the AVX-512 paths run instead."""

CFLAGS_ENV = "KVSERVE_KERNEL_CFLAGS"
"""Compile flags added after FLAGS (part of the cache key): `-mno-avx512f` builds the kernels
as for a CPU without AVX-512, with KVSERVE_CPU_FEATURES=avx2 and torch's own caps
(benchmarks/README.md measures an AVX2-only CPU that way)."""


def load(source: Path) -> tuple[ctypes.CDLL | None, Built]:
    """The library of `source`, built or found in the cache, and how; none (and why) when
    $KVSERVE_CPU_KERNELS=0 turns the kernels off, or it cannot be built or loaded."""
    if os.environ.get("KVSERVE_CPU_KERNELS", "1") == "0":
        return None, Built(None, 0.0, "KVSERVE_CPU_KERNELS=0")
    built = build(source, tuple(os.environ.get(CFLAGS_ENV, "").split()))
    if built.path is None:
        return None, built
    try:
        return ctypes.CDLL(str(built.path)), built
    except OSError as exc:
        return None, Built(None, built.seconds, f"{built.path} does not load: {exc}")


POINTER, INT, INT64, FLOAT = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
"""The C types of the kernels' arguments (tensors are passed as data pointers)."""


def function(library: ctypes.CDLL, name: str, restype: type | None, *argtypes: type) -> Any:
    """`library.name` with its C signature declared (ctypes converts and checks each call)."""
    fn = getattr(library, name)
    fn.restype = restype
    fn.argtypes = list(argtypes)
    return fn


def address(fn: Any) -> int:
    """The C address of a loaded function (for a kernel that calls another library's:
    decode_layers.c)."""
    value = ctypes.cast(fn, ctypes.c_void_p).value
    assert value is not None
    return value
