"""The default thread count: $OMP_NUM_THREADS, else physical cores, capped by a CPU quota."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvserve.model.threads import (
    cgroup_cpu_limit,
    default_num_threads,
    physical_cores,
    release_openmp_pool,
    usable_cpus,
)


def topology(root: Path, siblings: dict[int, str]) -> Path:
    """A sysfs-like tree: cpuN/topology/thread_siblings_list for each CPU."""
    for cpu, text in siblings.items():
        d = root / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "thread_siblings_list").write_text(text + "\n")
    return root


def test_hyperthread_siblings_count_once(tmp_path):
    # Two cores with two hyperthreads each (0,2 and 1,3), as Linux lists them.
    sysfs = topology(tmp_path, {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"})
    assert physical_cores([0, 1, 2, 3], sysfs) == 2
    assert physical_cores([0, 2], sysfs) == 1  # pinned to one core's two threads
    assert physical_cores([0, 1], sysfs) == 2


def test_cpus_without_topology_count_as_cores(tmp_path):
    assert physical_cores([0, 1, 5], tmp_path) == 3


def test_cgroup_quota(tmp_path):
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("150000 100000\n")
    assert cgroup_cpu_limit(cpu_max) == 1.5
    cpu_max.write_text("max 100000\n")
    assert cgroup_cpu_limit(cpu_max) is None
    assert cgroup_cpu_limit(tmp_path / "absent") is None


@pytest.fixture
def no_omp(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


def test_default_is_the_usable_physical_cores_shared_out(tmp_path, no_omp):
    cpus = usable_cpus()
    sysfs = topology(tmp_path / "sys", {c: str(c) for c in cpus})  # no hyperthreads
    unlimited = tmp_path / "cpu.max"
    unlimited.write_text("max 100000\n")
    assert default_num_threads(1, sysfs, unlimited) == len(cpus)
    assert default_num_threads(len(cpus) + 1, sysfs, unlimited) == 1  # never 0
    quota = tmp_path / "quota"
    quota.write_text("100000 100000\n")  # one CPU's worth of time
    assert default_num_threads(1, sysfs, quota) == 1


def test_omp_num_threads_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_num_threads(2, tmp_path, tmp_path / "absent") == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "zero")
    assert default_num_threads(1, tmp_path, tmp_path / "absent") == len(usable_cpus())


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity here")
def test_usable_cpus_follow_the_affinity():
    assert usable_cpus() == sorted(os.sched_getaffinity(0))


RELEASE_IN_A_FRESH_PROCESS = """
import threading, time, torch
from kvserve.model.threads import openmp_runtime, release_openmp_pool
torch.set_num_threads(2)
x = torch.randn(256, 4096)
x.exp()  # a parallel region: this thread's pool of workers
print(openmp_runtime(), release_openmp_pool())
out = []
worker = threading.Thread(target=lambda: out.append(float(x.exp().sum())))
worker.start(); worker.join()
print(x.exp().sum().item() == out[0])  # both threads still compute (a new pool each)
"""


def test_the_loading_thread_releases_its_gnu_openmp_pool_and_parallel_work_goes_on():
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # torch's own runtime
    done = subprocess.run(
        [sys.executable, "-c", RELEASE_IN_A_FRESH_PROCESS],
        capture_output=True, text=True, env=env, timeout=120, check=True,
    )  # fmt: skip
    first, same = done.stdout.splitlines()[:2]
    runtime, released = first.rsplit(" ", 1)
    if runtime != "GNU OpenMP":
        pytest.skip(f"torch runs {runtime} here")
    assert (released, same) == ("True", "True"), done.stdout


def test_intel_openmp_and_unreadable_maps_are_left_alone(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /opt/lib/libiomp5.so\n")
    assert not release_openmp_pool(maps)
    assert not release_openmp_pool(tmp_path / "missing")
