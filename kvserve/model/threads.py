"""How many CPU threads an engine uses when it is not told, and why.

The rule: `$OMP_NUM_THREADS` when set; else one thread per physical core
this process may run on: its CPU affinity (a `taskset` or a container's
cpuset), at most its cgroup's CPU quota (`docker --cpus`), hyperthread
siblings counted once (a second thread on a core shares its vector units:
matrix kernels gain nothing from it, and the barriers between threads cost).
Several engines on one host (`serve --data-parallel-size N`) split those
cores evenly, at least one thread each.

Why all the cores and not one: measured with benchmarks/cpu_real.py on the
default model (2 cores, benchmarks/README.md), every mode decodes as fast or
faster with both cores, batched and one request at a time, since the decode
step stopped paying a barrier per small op (kvserve/model/quant/fusion.py).
"""

from __future__ import annotations

import ctypes
import math
import os
from pathlib import Path

SYSFS_CPUS = Path("/sys/devices/system/cpu")
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def env_threads() -> int | None:
    """$OMP_NUM_THREADS when it is a positive integer."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def usable_cpus() -> list[int]:
    """The logical CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def physical_cores(cpus: list[int], sysfs: Path = SYSFS_CPUS) -> int:
    """How many cores `cpus` span: hyperthread siblings count once (each CPU's
    `topology/thread_siblings_list`; a CPU without one counts as its own core)."""
    cores: set[str] = set()
    for cpu in cpus:
        try:
            siblings = (sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text()
        except OSError:
            siblings = f"own {cpu}"
        cores.add(siblings.strip())
    return max(len(cores), 1)


def cgroup_cpu_limit(path: Path = CGROUP_CPU_MAX) -> float | None:
    """CPUs' worth of time the cgroup may use (cgroup v2 `cpu.max`: "QUOTA PERIOD"), or None."""
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None


def default_num_threads(
    share: int = 1, sysfs: Path = SYSFS_CPUS, cpu_max: Path = CGROUP_CPU_MAX
) -> int:
    """Threads for one of `share` engines on this host (the rule in the module's docstring)."""
    if (env := env_threads()) is not None:
        return env
    cores = physical_cores(usable_cpus(), sysfs)
    limit = cgroup_cpu_limit(cpu_max)
    if limit is not None:
        cores = min(cores, max(math.ceil(limit), 1))
    return max(cores // max(share, 1), 1)


def openmp_runtime(maps: Path = Path("/proc/self/maps")) -> str:
    """Which OpenMP runtime serves this process's parallel regions, for the start-up log:
    Intel's when libiomp5 is mapped (preloaded: kvserve.cli.openmp), else torch's GNU one."""
    try:
        mapped = maps.read_text()
    except OSError:
        return "OpenMP"
    return "Intel OpenMP" if "libiomp5" in mapped else "GNU OpenMP"


OMP_PAUSE_SOFT = 1
"""omp_pause_resource_t's omp_pause_soft (OpenMP 5.0)."""


def release_openmp_pool(maps: Path = Path("/proc/self/maps")) -> bool:
    """Release the calling thread's GNU OpenMP workers (omp_pause_resource_all, soft); whether
    a runtime took the call.

    libgomp keeps a pool of workers for each thread that ever ran a parallel region, and
    once the pools hold more threads than the process has CPUs, every worker stops
    spinning at the barriers and sleeps: each of a step's many small regions then pays a
    wake-up. `kvserve serve` loads the model on one thread and steps on the engine thread,
    so the loading thread's idle pool slowed every step: 8 prompts of 256 tokens to 64
    tokens each, 2 threads, took 5.6 s on the loading thread and 6.7 s on another, 5.3-5.8 s
    there once the loading thread's pool was released. A later parallel region of the
    calling thread builds a new pool. Intel's runtime (libiomp5) does not throttle its
    workers so; it is left alone."""
    try:
        mapped = maps.read_text()
    except OSError:
        return False
    if "libiomp5" in mapped:
        return False
    paths = {line.split()[-1] for line in mapped.splitlines() if "libgomp" in line}
    released = False
    for path in sorted(p for p in paths if p.startswith("/")):
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.restype, pause.argtypes = ctypes.c_int, [ctypes.c_int]
        released = pause(OMP_PAUSE_SOFT) == 0 or released
    return released
