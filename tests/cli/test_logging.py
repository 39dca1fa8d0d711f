"""The command line shows kvserve's INFO log lines (README promises some); the library
adds no handler, so a program that imports kvserve decides what its log shows."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
from _cli import SMALL, kvserve

from kvserve.cli import build_parser

KV_LINE = "INFO kvserve.model.runner: KV cache: 64 blocks of 4 tokens, hash block 4 tokens"


@pytest.mark.slow
def test_cli_logs_info_by_default_and_the_library_stays_quiet(demo_path):
    proc = kvserve("generate", "--model", demo_path, *SMALL, "--prompt", "hi", "--max-tokens", "2")
    assert proc.returncode == 0, proc.stderr
    assert KV_LINE in proc.stderr
    quiet = ("--log-level", "warning")
    proc = kvserve(
        "generate", "--model", demo_path, *SMALL, *quiet, "--prompt", "hi", "--max-tokens", "2"
    )
    assert proc.returncode == 0, proc.stderr
    assert "KV cache" not in proc.stderr
    # A program that imports kvserve sees nothing until it configures logging; then the line.
    # One process for both halves (it builds the engine twice): a marker parts its stderr.
    script = (
        "import logging, sys\n"
        "from kvserve import LLM, SamplingParams\n"
        "def run():\n"
        f"    llm = LLM({demo_path!r}, num_kv_blocks=64, block_size=4)\n"
        "    print(llm.generate('hi', SamplingParams(max_tokens=2), use_tqdm=False)[0].finished)\n"
        "run()\n"
        "print('--- configured', file=sys.stderr, flush=True)\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "run()\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    lib = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert lib.returncode == 0 and lib.stdout == "True\nTrue\n", lib.stderr
    quiet_part, configured_part = lib.stderr.split("--- configured\n")
    assert "KV cache" not in quiet_part
    assert "KV cache: 64 blocks of 4 tokens" in configured_part


def test_every_command_takes_log_level():
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert len(commands.choices) == 7
    for name, parser in commands.choices.items():
        required = ["--connect", "tcp://127.0.0.1:1"] if name == "events" else []
        required += ["--model", "m"] if name == "kv-metadata" else []
        required += ["--replica", "http://127.0.0.1:1"] if name == "route" else []
        assert parser.parse_args([*required]).log_level == "info", name
        assert parser.parse_args([*required, "--log-level", "DEBUG"]).log_level == "debug"
        with pytest.raises(SystemExit):
            parser.parse_args([*required, "--log-level", "loud"])
