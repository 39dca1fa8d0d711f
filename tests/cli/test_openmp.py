"""The engine commands start on the OpenMP runtime KVSERVE_OPENMP chooses (Intel's where it
is installed), by re-executing themselves with it preloaded."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _cli import SMALL, one_line_error

from kvserve.cli.openmp import ENV, INTEL, chosen_library, launched_as_kvserve

TORCH_GOMP = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
"""A real OpenMP runtime on every machine with torch's CPU wheel: preloading it proves the
re-execution without Intel's package."""


def generate(demo_path: str, *options: str, **env: str) -> subprocess.CompletedProcess[str]:
    argv = ["generate", "--model", demo_path, *SMALL, "--prompt", "hi", "--max-tokens", "2"]
    argv += options
    return subprocess.run(
        [sys.executable, "-m", "kvserve.cli", *argv],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        timeout=300,
    )


def test_the_choice(tmp_path):
    assert chosen_library({ENV: "gnu"}, str(tmp_path)) is None
    assert chosen_library({}, str(tmp_path)) is None  # auto, and nothing installed
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / INTEL).write_bytes(b"")
    assert chosen_library({}, str(tmp_path)) == tmp_path / "lib" / INTEL
    assert chosen_library({ENV: "auto"}, str(tmp_path)) == tmp_path / "lib" / INTEL
    assert chosen_library({ENV: "gnu"}, str(tmp_path)) is None
    assert chosen_library({ENV: str(TORCH_GOMP)}, str(tmp_path)) == TORCH_GOMP
    with pytest.raises(ValueError, match=f"{ENV}='/nowhere/libx.so': no such library"):
        chosen_library({ENV: "/nowhere/libx.so"}, str(tmp_path))


def test_only_the_command_itself_re_executes():
    import kvserve

    package = Path(kvserve.__file__).parent
    assert launched_as_kvserve(str(Path(sys.prefix) / "bin" / "kvserve"))
    assert launched_as_kvserve(str(package / "__main__.py"))  # python -m kvserve
    assert launched_as_kvserve(str(package / "cli" / "__main__.py"))  # python -m kvserve.cli
    assert not launched_as_kvserve("-c")  # a program that calls main() itself
    assert not launched_as_kvserve("/srv/app/__main__.py")
    assert not launched_as_kvserve("/srv/app/cli/__main__.py")


@pytest.mark.slow
@pytest.mark.skipif(not TORCH_GOMP.is_file(), reason="torch without its own libgomp")
def test_a_chosen_runtime_is_preloaded_and_said(demo_path):
    proc = generate(demo_path, "--log-level", "debug", **{ENV: str(TORCH_GOMP)})
    assert proc.returncode == 0, proc.stderr
    assert f"OpenMP: {TORCH_GOMP} preloaded ({ENV})" in proc.stderr  # said at DEBUG only
    assert "thread(s), GNU OpenMP" in proc.stderr
    assert "'" in proc.stdout  # the completion, printed by the re-executed process
    bad = generate(demo_path, **{ENV: "/nowhere/libiomp5.so"})
    assert ENV in one_line_error(bad, "/nowhere/libiomp5.so")
    refused = generate(demo_path, "--device", "tpu", **{ENV: str(TORCH_GOMP)})
    one_line_error(refused, "tpu")  # the re-executed process's errors stay one line


@pytest.mark.skipif(
    not (Path(sys.prefix) / "lib" / INTEL).is_file(), reason="intel-openmp not installed"
)
def test_intel_openmp_where_installed(demo_path):
    proc = generate(demo_path)
    assert proc.returncode == 0, proc.stderr
    assert "thread(s), Intel OpenMP" in proc.stderr
    assert "thread(s), GNU OpenMP" in generate(demo_path, **{ENV: "gnu"}).stderr
