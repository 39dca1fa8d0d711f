"""What the pytest-xdist workers of one test run make once and share: tiny checkpoints.

The first worker to ask for a checkpoint builds and saves it, under a file lock;
the others wait for it and load what it saved, so every worker's oracle is the
saved model itself. The folder is the run's own (a later run builds afresh).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock


def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder every worker of this run sees: xdist gives each worker a subfolder of the
    run's base temp folder; without xdist the base folder is the run's own."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    root.mkdir(exist_ok=True)
    return root


def saved_once(path: Path, build: Callable[[], Any], load: Callable[[Path], Any], **save) -> Any:
    """`build()`'s model saved at `path` (`save_pretrained(**save)`) by the first worker to
    come; a later one gets `load(path)`. Complete or absent: it is saved beside, then renamed."""
    with FileLock(f"{path}.lock"):
        if path.is_dir():
            return load(path)
        model = build()
        tmp = path.with_name(f"{path.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, **save)
        tmp.rename(path)
        return model
