"""`kvserve generate --json-schema FILE | --regex | --choice | --grammar FILE`: constrained
completions from a real process on the demo model; a bad constraint is a one-line error."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys

import pytest


def run(args, tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "kvserve.cli", "generate", "--no-progress"]
    return subprocess.run(
        [*command, "--model", "demo:random", "--num-kv-blocks", "256", "--max-tokens", "40", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def completions(stdout: str) -> list[str]:
    return [ast.literal_eval(m) for m in re.findall(r"^  ('.*'|\".*\")  \(stop\)$", stdout, re.M)]


def test_json_schema_from_a_file(tmp_path):
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["Paris", "Rome"]}, "sure": {"type": "boolean"}},
        "required": ["answer", "sure"],
    }
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    proc = run(["--json-schema", str(path)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    answers = completions(proc.stdout)
    assert len(answers) == 4
    for text in answers:
        value = json.loads(text)
        assert value["answer"] in ("Paris", "Rome") and isinstance(value["sure"], bool)


@pytest.mark.slow
def test_regex_and_choice(tmp_path):
    proc = run(["--regex", r"[0-9]{3}"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert [re.fullmatch(r"[0-9]{3}", t) is not None for t in completions(proc.stdout)] == [1] * 4
    proc = run(["--choice", "yes", "--choice", "no"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert set(completions(proc.stdout)) <= {"yes", "no"} and len(completions(proc.stdout)) == 4


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--regex", "a(b"], "regex"),
        (["--json-schema", "/nonexistent/schema.json"], "--json-schema"),
        (["--regex", "a", "--choice", "b"], "not allowed with"),
    ],
)
def test_a_bad_constraint_is_a_one_line_error(tmp_path, args, words):
    proc = run(args, tmp_path)
    assert proc.returncode == 2
    assert words in proc.stderr and "Traceback" not in proc.stderr
