"""Bad engine options on the command line: one line on stderr, exit status 2, no traceback.

Each runs `kvserve` as a user does, in its own process. Every error here comes before a
model is loaded (the device, the KV events config) or right after (the offload tiers,
on a tiny checkpoint).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


def kvserve(*args: str, cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "kvserve.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    """The single stderr line of a refused command (exit status 2, no traceback)."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"kvserve {proc.args[3]}: error: "), lines[0]
    return lines[0]


@pytest.mark.parametrize("device", ["tpu", "cuda", "cuda:99"])
def test_generate_refuses_a_device_it_cannot_use(device):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA: 'cuda' is a device it can use")
    line = one_line_error(kvserve("generate", "--device", device, "--max-tokens", "1"))
    assert f"device '{device}'" in line
    assert "'cpu'" in line  # what to use instead


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ("[1, 2]", "must be a JSON object"),
        ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events must be true or false"),
        ('{"hwm": 1.5}', "hwm must be an integer"),
        ('{"topic": 7}', "topic must be a string"),
    ],
)
def test_kv_events_config_is_checked_key_by_key(config, named):
    line = one_line_error(kvserve("generate", "--kv-events-config", config, "--max-tokens", "1"))
    assert named in line


def test_offload_tier_problems_name_the_tier(checkpoints, tmp_path):
    model = checkpoints["qwen3"].path
    a_file = tmp_path / "hostname"
    a_file.write_text("not a directory\n")
    base = ["generate", "--model", model]
    cases = {
        f"disk:{a_file}:1GiB": f"{a_file} is a file, not a directory",
        f"disk:{tmp_path}/kv:1KB": "cannot hold one KV block",
        "cpu:100B": "cannot hold one KV block",
    }
    for spec, reason in cases.items():
        line = one_line_error(kvserve(*base, "--offload", spec, "--max-tokens", "1"))
        assert f"offload tier '{spec}'" in line and reason in line
        assert "Errno" not in line
    assert not (tmp_path / "kv").exists()  # refused before anything was created
