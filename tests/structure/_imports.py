"""Which kvserve modules a module imports, read from its source: every import statement,
at module level, in a function or under TYPE_CHECKING."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kvserve"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every `kvserve...` module named by an import anywhere in the file."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("kvserve"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvserve"):
            # `from kvserve.kvcache import plan` names the module plan; the package is
            # named only when a name is taken from it (a parent package is never an edge:
            # `import kvserve.kvcache.plan` runs kvserve/kvcache/__init__.py too).
            submodules = {f"{node.module}.{a.name}" for a in node.names}
            submodules = {m for m in submodules if is_module(m)}
            names.update(submodules)
            if len(submodules) < len(node.names):
                names.add(node.module)
    return names


def is_module(name: str) -> bool:
    """Whether a dotted name is a module or package of kvserve (not a name inside one)."""
    path = PACKAGE.parent / name.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def import_graph(package: str) -> dict[str, set[str]]:
    """Module -> kvserve modules it imports, for every module of `package`."""
    folder = ROOT / package.replace(".", "/")
    return {module_name(p): imported_modules(p) for p in sorted(folder.rglob("*.py"))}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle among the graph's own modules, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in graph:
        if node not in state and (cycle := visit(node)):
            return cycle
    return None
