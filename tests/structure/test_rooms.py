"""The map's boundaries, read from the source: who may import what, no cycles, small files.

docs/design.md: the model room and the offload connector see the KV cache
only through its spec and plan types; the KV cache imports nothing else of
kvserve; no import cycle anywhere in the package (every import counts,
function-level and TYPE_CHECKING ones too: they are the same coupling).
"""

from __future__ import annotations

import ast
import subprocess
import sys
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


def test_no_import_cycle_in_the_package():
    """Every import counts: module level, inside a function, under TYPE_CHECKING (a deferred
    import is the same coupling, only hidden); a parent package is not an edge."""
    cycle = find_cycle(import_graph("kvserve"))
    assert cycle is None, " -> ".join(cycle or [])


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_a_submodule_imported_from_its_package_names_the_submodule_only(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("from kvserve.router import health\nfrom kvserve.cli import common, main\n")
    assert imported_modules(source) == {
        "kvserve.router.health",
        "kvserve.cli.common",
        "kvserve.cli",  # `main` is a name inside the package
    }


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


FORBIDDEN_IN_ROUTING = {"torch", "fastapi", "starlette", "uvicorn", "zmq"}


def runtime_imports(path: Path) -> set[str]:
    """Modules a file imports when it runs: TYPE_CHECKING blocks left out."""

    def skip(node: ast.AST) -> bool:
        test = getattr(node, "test", None)
        return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(test)

    names: set[str] = set()
    stack: list[ast.AST] = [ast.parse(path.read_text())]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
        stack.extend(child for child in ast.iter_child_nodes(node) if not skip(child))
    return names


@pytest.mark.parametrize("path", sorted((PACKAGE / "routing").rglob("*.py")), ids=lambda p: p.name)
def test_routing_runs_on_plain_numbers(path):
    """The policy imports no engine, model, server or transport; kvserve types only
    under TYPE_CHECKING (so a router process loads nothing it does not use)."""
    names = runtime_imports(path)
    kvserve = {n for n in names if n.startswith("kvserve") and not n.startswith("kvserve.routing")}
    assert not kvserve, f"{path.name} imports {sorted(kvserve)}"
    heavy = {n for n in names if n.split(".")[0] in FORBIDDEN_IN_ROUTING}
    assert not heavy, f"{path.name} imports {sorted(heavy)}"


def test_importing_routing_loads_no_heavy_module():
    code = "import sys, kvserve.routing; print(sorted({m.split('.')[0] for m in sys.modules}))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    loaded = set(ast.literal_eval(result.stdout))
    assert "kvserve" in loaded and not loaded & FORBIDDEN_IN_ROUTING


def test_the_runtime_import_reader_leaves_out_type_checking(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from kvserve.events.index import PrefixIndex\n"
        "import zmq\n"
        "def f():\n    from kvserve.engine import scheduler\n"
    )
    assert runtime_imports(source) == {"typing", "zmq", "kvserve.engine"}


def line_counts(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in folder.rglob("*.py")}


def test_source_files_stay_small():
    long = {p: n for p, n in line_counts(PACKAGE).items() if n > 400}
    assert not long, f"split by concept: {long}"


def test_test_files_stay_small():
    long = {p: n for p, n in line_counts(ROOT / "tests").items() if n > 500}
    assert not long, f"split by topic: {long}"


@pytest.mark.parametrize(
    "path", sorted((PACKAGE / "structured").rglob("*.py")), ids=lambda p: p.name
)
def test_structured_knows_only_the_sampling_params(path):
    """The grammar room (xgrammar) reads a request's constraint and nothing else of
    kvserve: the engine owns its states, the runner only reads them."""
    names = {n for n in imported_modules(path) if n.startswith("kvserve")}
    names = {n for n in names if not n.startswith("kvserve.structured")}  # its own room
    assert names <= {"kvserve.sampling_params"}, f"{path.name} imports {sorted(names)}"


def test_plain_engines_and_the_kv_cache_load_no_grammar_backend():
    """xgrammar (and its torch) load only with the first constrained request."""
    code = (
        "import sys, kvserve.kvcache, kvserve.kvcache.manager\n"
        "early = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'xgrammar'})\n"
        "import kvserve.engine.llm_engine, kvserve.model.runner\n"
        "print(early, 'xgrammar' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[]", "False"]


@pytest.mark.parametrize(
    "path", sorted((PACKAGE / "tool_calls").rglob("*.py")), ids=lambda p: p.name
)
def test_tool_calls_know_only_the_request_side(path):
    """Tool calling reads requests and text: no server, engine or grammar backend."""
    allowed = {"kvserve.sampling_params", "kvserve.chat_template", "kvserve.structured.tags"}
    names = {n for n in imported_modules(path) if n.startswith("kvserve")}
    outside = {n for n in names if not n.startswith("kvserve.tool_calls")} - allowed
    assert not outside, f"{path.name} imports {sorted(outside)}"
    assert "xgrammar" not in {n.split(".")[0] for n in imported_modules(path)}
