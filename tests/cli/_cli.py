"""Running `kvserve` as a user does: a real process, this tree's code, one thread."""

from __future__ import annotations

import os
import subprocess
import sys

# Small pools: the default sizes the KV cache from free memory (gigabytes).
SMALL = ("--no-progress", "--num-kv-blocks", "64", "--block-size", "4")


def kvserve(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvserve.cli", *argv],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "1000"},
        timeout=timeout,
    )


def one_line_error(proc: subprocess.CompletedProcess[str], *names: str) -> str:
    """The usage error of `proc`: exit 2, one line on stderr naming `names`, no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]
