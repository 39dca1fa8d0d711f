"""Bad engine options on the command line: one line on stderr, exit status 2, no traceback.

Each runs `kvserve` as a user does, in its own process. Every error here comes before a
model is loaded (the device, the KV events config) or right after (an offload tier, on
a tiny checkpoint).
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


@pytest.mark.parametrize("share", ["0", "1.5"])
def test_gpu_memory_utilization_outside_0_1_is_refused(share):
    line = one_line_error(
        kvserve("generate", "--gpu-memory-utilization", share, "--max-tokens", "1")
    )
    assert f"gpu_memory_utilization must be in (0, 1], got {float(share)}" in line


def test_an_offload_path_that_is_a_file_says_so(checkpoints, tmp_path):
    # (A tier too small for one block: tests/offload/test_tier_failures.py, in Python.)
    a_file = tmp_path / "hostname"
    a_file.write_text("not a directory\n")
    spec = f"disk:{a_file}:1GiB"
    model = checkpoints["qwen3"].path
    # The tier is checked once the pool's block size is known: after the model's INFO line.
    args = ("--num-kv-blocks", "64", "--log-level", "warning", "--offload", spec)
    line = one_line_error(kvserve("generate", "--model", model, *args))
    assert line.endswith(f"offload tier '{spec}': {a_file} is a file, not a directory")


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["generate", "--kv-cache-memory", "2XB"], "--kv-cache-memory"),
        (["serve", "--port", "x"], "--port"),
        (["simulate", "--block-size", "0"], "--block-size"),
    ],
)
def test_an_option_argparse_refuses_is_one_line_too(args, names):
    line = one_line_error(kvserve(*args))
    assert names in line and line.endswith(f"(see kvserve {args[0]} --help)")
