"""The serve room's thread boundary: only the engine thread touches the engine."""

from __future__ import annotations

import re

from _imports import ROOT, imported_modules

SERVE = ROOT / "kvserve" / "serve"
RAY = ROOT / "kvserve" / "ray"
ENGINE_CALLS = re.compile(r"\.(step|add_request|abort_request|has_unfinished_requests)\(")


def test_only_the_engine_thread_steps_or_changes_the_engine():
    for path in SERVE.rglob("*.py"):
        if path == SERVE / "http" / "engine_thread.py":
            continue
        calls = ENGINE_CALLS.findall(path.read_text())
        assert not calls, f"{path.relative_to(SERVE)} calls the engine ({calls}) outside its thread"


def test_no_other_room_imports_serve():
    """Only its hosts: `kvserve serve` (cli/serve.py) and the Ray Serve replica (ray/)."""
    for path in (ROOT / "kvserve").rglob("*.py"):
        if path.is_relative_to(SERVE) or path.name == "serve.py" or path.is_relative_to(RAY):
            continue
        bad = [m for m in imported_modules(path) if m.startswith("kvserve.serve")]
        assert not bad, f"{path} imports {bad}"


LAYERS = {
    "http": set(),
    "request": {"http"},
    "state": {"http", "request", "responses_api"},  # the Responses API's store
    "generation": {"http", "request", "state"},
    "openai": {"http", "request", "state", "generation"},
    "responses_api": {"http", "request", "state", "generation"},
    "messages_api": {"http", "request", "state", "generation", "responses_api"},
}
"""Each of serve's sub-rooms (and state.py) -> the ones it may import (docs/design.md): the
plumbing first, then bodies read, the shared state, one request's life, the APIs; app.py,
build.py and lifecycle.py at the top wire them all."""


def test_serve_sub_rooms_import_in_layers():
    rooms = {p.name for p in SERVE.iterdir() if (p / "__init__.py").exists()}
    assert rooms <= set(LAYERS), f"a new sub-room needs its layer here: {rooms - set(LAYERS)}"
    for path in SERVE.rglob("*.py"):
        parts = path.relative_to(SERVE).parts
        room = parts[0] if len(parts) > 1 else path.stem
        if room not in LAYERS:
            continue
        used = {m.split(".")[2] for m in imported_modules(path) if m.startswith("kvserve.serve.")}
        bad = used - {room} - LAYERS[room]
        assert not bad, f"{path.relative_to(SERVE)} imports serve's {sorted(bad)}"
