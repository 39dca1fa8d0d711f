"""The README's architectures table lists exactly what kvserve runs, and a checkpoint of
any other architecture is refused naming exactly those (HF and GGUF alike)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from kvserve.model import ModelLoadError, load_model
from kvserve.model.checkpoint.gguf_config import ARCHITECTURES as GGUF_ARCHITECTURES
from kvserve.model.models import MODEL_REGISTRY

README = Path(__file__).resolve().parents[2] / "README.md"


def table_rows() -> list[list[str]]:
    text = README.read_text(encoding="utf-8")
    section = text.split("## Architectures", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def first_name(cell: str) -> str | None:
    """The cell's first `name` (a GGUF cell may qualify it: `llama` with `...`), or None."""
    found = re.search(r"`([^`]+)`", cell)
    return None if found is None else found.group(1)


def test_the_table_has_one_row_per_architecture_kvserve_runs():
    rows = table_rows()
    hf = [first_name(row[0]) for row in rows]
    assert sorted(hf) == sorted(MODEL_REGISTRY)  # one row each, none missing, none extra
    gguf = {first_name(row[1]) for row in rows} - {None}
    assert gguf == set(GGUF_ARCHITECTURES)
    for row in rows:  # a GGUF name's row is the architecture the file runs as
        name = first_name(row[1])
        if name is not None and name != "llama":
            assert first_name(row[0]) == GGUF_ARCHITECTURES[name], row


def test_an_unsupported_config_is_refused_naming_exactly_the_supported_ones(
    dense_checkpoints, tmp_path
):
    path = tmp_path / "ck"
    shutil.copytree(dense_checkpoints["mistral"].path, path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as info:
        load_model(path, dtype=torch.float32, device=torch.device("cpu"))
    supported = ", ".join(sorted(MODEL_REGISTRY))
    message = f"architecture 'GPT2LMHeadModel' is not supported; supported: {supported}"
    assert str(info.value) == message
