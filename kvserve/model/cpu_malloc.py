"""Keep freed memory for reuse instead of handing it back to the kernel (glibc).

A step on the CPU allocates and frees the same large tensors every time: the
logits (64 rows x 49,152 float32 = 12.6 MB), the sampler's copies of them, a
prefill chunk's activations. glibc serves any block above its mmap threshold
(128 KiB at first, raised only as such blocks are freed) with a fresh mmap and
unmaps it on free, and trims the heap's free top above 128 KiB: the next step
touches new pages, and every 4 KiB page faults and is zeroed by the kernel.
Measured on the default model (2 threads, benchmarks/README.md): sampling 64
rows took 28 ms of which most was page faults, 9 ms with the thresholds raised;
the prefill of 64 prompts of 256 tokens went from 7.8 to 6.1 s.

So an engine on the CPU raises both thresholds once (`mallopt`, the same knobs
as glibc's MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ variables): blocks up
to 32 MiB (glibc's largest mmap threshold on 64-bit) come from the heap, and up
to 1 GiB of freed heap stays mapped for the next step. vLLM's CPU guide gets the
same effect by preloading tcmalloc; this needs no extra library. Left alone when
the user set either variable or GLIBC_TUNABLES (their choice wins), or set
KVSERVE_MALLOC=default, and on a C library without mallopt (musl, macOS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import Callable
from typing import Any, cast

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
"""glibc's maximum (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit): mallopt refuses more."""
TRIM_THRESHOLD = 1 << 30
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds once per process; whether they are raised."""
    global _applied
    if _applied is None:
        _applied = _apply(os.environ)
    return _applied


def _apply(env: os._Environ[str] | dict[str, str]) -> bool:
    if env.get("KVSERVE_MALLOC", "").strip().lower() == "default":
        return False
    if any(name in env for name in USER_SETTINGS):
        return False
    mallopt = _glibc_mallopt()
    if mallopt is None:
        return False
    # The mmap threshold first: setting it also stops glibc's dynamic adjustment of both.
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    if not ok:
        log.debug("mallopt refused the thresholds; the allocator keeps its defaults")
    return ok


def give_back_freed_memory() -> bool:
    """glibc's malloc_trim(0): the heap's free pages go back to the kernel. Called while
    a load frees large blocks for good (the weights' copies left behind when they move
    to huge pages, kvserve.model.memory.huge_pages), which the raised trim threshold would
    keep mapped: the default model's resident memory was 606 MB larger without it."""
    trim = _glibc_function("malloc_trim")
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return bool(trim(0))


def _glibc_mallopt() -> Callable[[int, int], int] | None:
    """glibc's mallopt(int, int), or None where the C library is not glibc."""
    mallopt = _glibc_function("mallopt")
    if mallopt is None:
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return cast(Callable[[int, int], int], mallopt)


def _glibc_function(symbol: str) -> Any:
    """A function of glibc, or None where the C library is not glibc (musl's mallopt and
    malloc_trim do nothing)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        if not hasattr(libc, "gnu_get_libc_version"):
            return None
        return getattr(libc, symbol)
    except (OSError, AttributeError):
        return None
