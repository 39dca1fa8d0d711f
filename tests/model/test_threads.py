"""The default thread count: $OMP_NUM_THREADS, else physical cores, capped by a CPU quota."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvserve.model.threads import (
    cgroup_cpu_limit,
    default_num_threads,
    physical_cores,
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
