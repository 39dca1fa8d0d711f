"""The model room's sub-rooms and who may import whom (docs/design.md, Boundaries).

Each folder of kvserve/model holds one concern; the arrows between them point one way.
The files directly in kvserve/model compose the rooms (the runner, its chunk check and draft
model, the loader, the demo checkpoint, the device and thread checks): no room imports them,
nor the package's lazy facade (kvserve.model). Every import counts, function-level ones too.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from _imports import PACKAGE, ROOT, imported_modules

MODEL = PACKAGE / "model"

MAY_IMPORT = {
    "checkpoint": set(),
    "sampling": set(),
    "pooling": set(),
    "layers": {"checkpoint", "cpu_kernels"},
    "quant": {"checkpoint", "cpu_kernels"},
    "cpu_kernels": set(),
    "attention": {"layers", "cpu_kernels"},
    "memory": {"checkpoint", "layers"},
    "models": {"checkpoint", "layers", "attention"},
}
"""Per room, the other model rooms it may import (its own always)."""

TOP = {"__init__", "runner", "chunk_check", "draft_model", "loader", "demo", "demo_text", "device",
       "threads", "cpu_malloc", "fused_decode"}  # fmt: skip
"""The files directly in kvserve/model: what composes the rooms (the runner's chunk check and
speculation's draft model, which the runner loads beside its own, are the runner's; the fused
decode joins the models' layers to the C kernels for the CPU runner)."""


def room_of(module: str) -> str | None:
    """`kvserve.model.<room>...` -> room; None for the top and for modules outside model."""
    parts = module.split(".")
    if parts[:2] != ["kvserve", "model"] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in MAY_IMPORT else None


def room_files() -> list[Path]:
    return sorted(p for room in MAY_IMPORT for p in (MODEL / room).rglob("*.py"))


@pytest.mark.parametrize("path", room_files(), ids=lambda p: str(p.relative_to(MODEL)))
def test_a_room_imports_only_the_rooms_below_it(path):
    room = path.relative_to(MODEL).parts[0]
    allowed = MAY_IMPORT[room] | {room}
    model = {m for m in imported_modules(path) if m.split(".")[:2] == ["kvserve", "model"]}
    bad = {m for m in model if room_of(m) not in allowed}
    assert not bad, f"{path.relative_to(ROOT)} ({room}/) may not import {sorted(bad)}"


def test_every_model_file_is_in_a_room_or_named_at_the_top():
    top = {p.stem for p in MODEL.glob("*.py")}
    folders = {p.name for p in MODEL.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert top == TOP, f"a new file goes into a room (or into TOP, on purpose): {top ^ TOP}"
    assert folders == set(MAY_IMPORT), f"a new room comes with its rules: {folders}"


def test_the_room_rules_have_no_circle():
    """The allowed arrows themselves point one way (a room may not reach itself)."""

    def reach(room: str, seen: set[str]) -> set[str]:
        for other in MAY_IMPORT[room] - seen:
            seen.add(other)
            reach(other, seen)
        return seen

    assert [room for room in MAY_IMPORT if room in reach(room, set())] == []


def test_reading_a_tokenizer_loads_no_torch():
    """The router reads tokenizers through checkpoint/ without the model's torch code."""
    code = (
        "import sys, kvserve.model.checkpoint.tokenizer\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'"
        " or m.startswith('kvserve.model.') and not m.startswith('kvserve.model.checkpoint')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout
