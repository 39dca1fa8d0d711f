"""Ray is an optional extra: only kvserve/ray imports it, and nothing else of kvserve imports
kvserve/ray, so `kvserve serve`, `route` and the library run without Ray installed."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from _imports import PACKAGE, ROOT, imported_modules

RAY_ROOM = PACKAGE / "ray"


def outside_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if RAY_ROOM not in p.parents)


def imports_ray(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "ray" for a in node.names):
            return True
        module = node.module if isinstance(node, ast.ImportFrom) and node.level == 0 else None
        if module and module.split(".")[0] == "ray":
            return True
    return False


@pytest.mark.parametrize("path", outside_files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_only_the_ray_room_imports_ray(path):
    assert not imports_ray(path), f"{path.relative_to(ROOT)} imports ray"
    room = {m for m in imported_modules(path) if m == "kvserve.ray" or m.startswith("kvserve.ray.")}
    assert not room, f"{path.relative_to(ROOT)} imports {sorted(room)}"


def test_the_ray_room_imports_ray(tmp_path):
    """The reader above sees an import of Ray (else the test before proves nothing)."""
    assert imports_ray(RAY_ROOM / "router.py")
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from ray.serve import deployment\n")
    assert imports_ray(source)


def test_serving_and_routing_load_no_ray():
    code = (
        "import sys, kvserve, kvserve.cli, kvserve.router.build\n"
        "sys.exit(1 if any(m.split('.')[0] == 'ray' for m in sys.modules) else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0
