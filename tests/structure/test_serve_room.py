"""The serve room's thread boundary: only the engine thread touches the engine."""

from __future__ import annotations

import re

from _imports import ROOT, imported_modules

SERVE = ROOT / "kvserve" / "serve"
RAY = ROOT / "kvserve" / "ray"
ENGINE_CALLS = re.compile(r"\.(step|add_request|abort_request|has_unfinished_requests)\(")


def test_only_the_engine_thread_steps_or_changes_the_engine():
    for path in SERVE.glob("*.py"):
        if path.name == "engine_thread.py":
            continue
        calls = ENGINE_CALLS.findall(path.read_text())
        assert not calls, f"{path.name} calls the engine ({calls}) outside its thread"


def test_no_other_room_imports_serve():
    """Only its hosts: `kvserve serve` (cli/serve.py) and the Ray Serve replica (ray/)."""
    for path in (ROOT / "kvserve").rglob("*.py"):
        if path.is_relative_to(SERVE) or path.name == "serve.py" or path.is_relative_to(RAY):
            continue
        bad = [m for m in imported_modules(path) if m.startswith("kvserve.serve")]
        assert not bad, f"{path} imports {bad}"
