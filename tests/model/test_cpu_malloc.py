"""Freed memory kept for reuse on the CPU (kvserve.model.cpu_malloc): the thresholds are
raised where glibc is the C library, and a freed large block is then reused without
page faults; the user's own settings win."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys

import pytest

from kvserve.model import cpu_malloc

GLIBC = sys.platform == "linux" and cpu_malloc._glibc_mallopt() is not None

# Eight 12 MiB blocks (the logits of 64 rows of a 49,152-token vocabulary) alive at
# once, then freed, twelve times; prints the minor page faults of the last ten rounds.
# glibc's defaults trim the freed heap (or unmap the blocks) and fault the pages in
# again most runs (242,368 faults here); kept, the pages are reused.
FAULTS = """
import resource, sys, torch
from kvserve.model.cpu_malloc import keep_freed_memory
print(keep_freed_memory(), file=sys.stderr)
for round in range(12):
    if round == 2:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [torch.ones(3 << 20) for _ in range(8)]
    del blocks
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(**env: str) -> tuple[int, str]:
    clean = {k: v for k, v in os.environ.items() if k not in cpu_malloc.USER_SETTINGS}
    clean.pop("KVSERVE_MALLOC", None)
    proc = subprocess.run(
        [sys.executable, "-c", FAULTS], env={**clean, **env}, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.strip()), proc.stderr.strip()


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt only")
def test_a_freed_large_block_is_reused_without_page_faults():
    tuned, applied = _faults()
    assert applied == "True"
    pages = 10 * 8 * (12 << 20) // 4096  # every page of every block, faulted afresh
    assert tuned < pages // 20, f"{tuned} page faults of {pages} pages"
    assert _faults(KVSERVE_MALLOC="default")[1] == "False"


@pytest.mark.parametrize(
    "env",
    [
        {"KVSERVE_MALLOC": "default"},
        {"MALLOC_MMAP_THRESHOLD_": "65536"},
        {"MALLOC_TRIM_THRESHOLD_": "0"},
        {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"},
    ],
)
def test_the_users_own_allocator_settings_win(env):
    assert cpu_malloc._apply(env) is False


def test_without_glibc_nothing_is_changed(monkeypatch):
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    assert cpu_malloc._glibc_mallopt() is None
    assert cpu_malloc._apply({}) is False
