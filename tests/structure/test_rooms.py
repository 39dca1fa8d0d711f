"""The map's boundaries, read from the source: who may import what, no cycles, small files.

docs/design.md: the model room and the offload connector see the KV cache
only through its spec and plan types; the KV cache imports nothing else of
kvserve; no import cycle inside it (TYPE_CHECKING imports count: they are
the same coupling).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _imports import PACKAGE, ROOT, find_cycle, import_graph, imported_modules

KVCACHE_FOR_READERS = {"kvserve.kvcache.specs", "kvserve.kvcache.plan"}
"""What the runner side may know of the KV cache: what groups are, and a step's plan."""


def kvcache_imports(path: Path) -> set[str]:
    return {m for m in imported_modules(path) if m.startswith("kvserve.kvcache")}


@pytest.mark.parametrize(
    "path",
    [*sorted((PACKAGE / "model").rglob("*.py")), PACKAGE / "offload" / "connector.py"],
    ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_runner_side_sees_only_specs_and_plans(path):
    extra = kvcache_imports(path) - KVCACHE_FOR_READERS
    assert not extra, f"{path.relative_to(ROOT)} imports {sorted(extra)}"


def test_kvcache_imports_nothing_else_of_kvserve():
    graph = import_graph("kvserve.kvcache")
    outside = {
        (module, name)
        for module, names in graph.items()
        for name in names
        if not name.startswith("kvserve.kvcache")
    }
    assert not outside, sorted(outside)


@pytest.mark.parametrize(
    "package", ["kvserve.kvcache", "kvserve.engine", "kvserve.model", "kvserve.offload"]
)
def test_no_import_cycle(package):
    assert find_cycle(import_graph(package)) is None


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_import_reader_sees_type_checking_and_function_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from kvserve.kvcache.manager import KVCacheManager\n"
        "def f():\n    import kvserve.kvcache.pool\n"
        "from kvserve.kvcache import plan\n"
    )
    assert imported_modules(source) >= {
        "kvserve.kvcache.manager",
        "kvserve.kvcache.pool",
        "kvserve.kvcache.plan",
    }


def line_counts(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in folder.rglob("*.py")}


def test_source_files_stay_small():
    long = {p: n for p, n in line_counts(PACKAGE).items() if n > 400}
    assert not long, f"split by concept: {long}"


def test_test_files_stay_small():
    long = {p: n for p, n in line_counts(ROOT / "tests").items() if n > 500}
    assert not long, f"split by topic: {long}"
