"""`kvserve kv-metadata` describes only what an engine could run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _cli import kvserve, one_line_error


@pytest.mark.slow
def test_an_unsupported_architecture_is_refused(checkpoints, tmp_path):
    config = json.loads((Path(checkpoints["qwen3"].path) / "config.json").read_text())
    proc = kvserve("kv-metadata", "--model", checkpoints["qwen3"].path)
    assert proc.returncode == 0 and json.loads(proc.stdout)["groups"], proc.stderr
    (tmp_path / "config.json").write_text(
        json.dumps({**config, "architectures": ["GPT2LMHeadModel"]})
    )
    proc = kvserve("kv-metadata", "--model", str(tmp_path))
    one_line_error(proc, "'GPT2LMHeadModel' is not supported", "Qwen3ForCausalLM")
    assert proc.stdout == ""
