"""The `kvserve` program: its entry points, `--version`, and help that says a default once."""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import kvserve
import kvserve.cli
from kvserve.cli import build_parser, version
from kvserve.engine.engine_args import EngineArgs

ROOT = Path(__file__).resolve().parents[2]


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "1000"}  # no wrapping: each option's help on one line
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120
    )


@pytest.mark.parametrize("module", ["kvserve", "kvserve.cli"])
def test_version_prints_and_exits_zero(module):
    proc = run("-m", module, "--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"kvserve {version()}\n"
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", version())


def test_version_falls_back_to_the_source_tree(monkeypatch):
    import importlib.metadata

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert version() == kvserve.__version__


def test_console_script_entry_point_is_main():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, name = scripts["kvserve"].partition(":")
    assert getattr(importlib.import_module(module), name) is kvserve.cli.main


def _option_entries(help_text: str) -> list[str]:
    """The help of each option, one string per option (wrapped lines joined)."""
    entries: list[str] = []
    for line in help_text.splitlines():
        if line.startswith("  -"):
            entries.append(line)
        elif line.startswith("   ") and entries:
            entries[-1] += " " + line.strip()
        else:
            entries.append("")
    return [entry for entry in entries if entry]


@pytest.mark.parametrize(
    "command", ["generate", "chat", "serve", "simulate", "kv-metadata", "events"]
)
def test_help_says_each_default_once(command):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    entries = _option_entries(sub.format_help())
    assert len(entries) > 4
    for entry in entries:
        assert entry.count("default") <= 1, entry
        assert "(default: None)" not in entry and "(default: False)" not in entry, entry


def test_generate_help_shows_every_engine_field():
    proc = run("-m", "kvserve", "generate", "--help")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "(default: 16)" in text and "(default: 8192)" in text
    for field in dataclasses.fields(EngineArgs):
        assert field.metadata["help"] in text, field.name
    for entry in _option_entries(proc.stdout):
        assert entry.count("(default:") <= 1, entry
