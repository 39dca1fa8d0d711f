"""The type checker's escape hatch stays rare (docs/development.md, Types): at most five
`# type: ignore` in kvserve/, each naming its error code and saying why on its line;
and CI runs the checker."""

from __future__ import annotations

import re
import tomllib

from _imports import PACKAGE, ROOT
from test_promises import readme_commands

MAX_IGNORES = 5

IGNORE = re.compile(r"#\s*type:\s*ignore\b(?P<codes>\[[^\]]*\])?(?P<rest>.*)$")
"""A `# type: ignore`, its `[codes]`, and what follows them on the line."""

REASON = re.compile(r"\s+#\s*\S")
"""After the codes, a comment of its own: `# type: ignore[code]  # why`."""


def type_ignores() -> list[tuple[str, re.Match[str]]]:
    """(file:line, match) for every `# type: ignore` in the package's source."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            match = IGNORE.search(line)
            if match:
                found.append((f"{path.relative_to(ROOT)}:{number}", match))
    return found


def test_at_most_five_type_ignores_in_the_package():
    places = [place for place, _ in type_ignores()]
    assert len(places) <= MAX_IGNORES, f"{len(places)} `# type: ignore` (at most 5): {places}"


def test_each_type_ignore_names_its_code_and_its_reason():
    bad = [
        place
        for place, match in type_ignores()
        if not match["codes"] or not REASON.match(match["rest"])
    ]
    assert bad == [], f"write `# type: ignore[code]  # why` on these lines: {bad}"


def test_the_check_recognises_what_it_counts():
    assert IGNORE.search("x = f()  # type: ignore[arg-type]  # the stub lacks it")
    assert not REASON.match(IGNORE.search("x = f()  # type: ignore[arg-type]")["rest"])
    assert IGNORE.search("x = f()  # type: ignore")["codes"] is None


def test_ci_runs_the_type_checker_between_ruff_and_pytest():
    _, tests = readme_commands()
    steps = tests.split(" && ")
    assert ".venv/bin/mypy" in steps, tests
    mypy = steps.index(".venv/bin/mypy")
    assert steps[mypy - 1].startswith(".venv/bin/ruff"), tests
    assert steps[mypy + 1] == ".venv/bin/python -m pytest", tests


def test_the_checker_covers_the_package_and_is_strict_on_kvcache():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert config["files"] == ["kvserve"]
    assert config["check_untyped_defs"] is True
    kvcache = next(o for o in config["overrides"] if o["module"] == "kvserve.kvcache.*")
    assert kvcache["disallow_untyped_defs"] is True and kvcache["disallow_any_generics"] is True
