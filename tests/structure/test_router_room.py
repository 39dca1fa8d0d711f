"""The router room's boundary: events, routing, the chat template and the tokenizer loading;
never the engine, the server or the model's torch code."""

from __future__ import annotations

import subprocess
import sys

import pytest
from _imports import PACKAGE, ROOT, imported_modules

ROUTER = PACKAGE / "router"
ALLOWED = (
    "kvserve.router",
    "kvserve.routing",
    "kvserve.events",
    "kvserve.chat_template",
    "kvserve.model.checkpoint.tokenizer",
    "kvserve.prompt_fields",
    "kvserve.request_limits",
    "kvserve.graceful_server",
    "kvserve.version",
)


@pytest.mark.parametrize(
    "path", sorted(ROUTER.glob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE))
)
def test_the_router_imports_only_what_it_may(path):
    bad = {
        m
        for m in imported_modules(path)
        if m != "kvserve" and not any(m == a or m.startswith(f"{a}.") for a in ALLOWED)
    }
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_importing_the_router_loads_no_engine_server_or_torch():
    code = (
        "import sys, kvserve.router\n"
        "bad = [m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith(("
        "'kvserve.engine', 'kvserve.serve', 'kvserve.llm', 'kvserve.model.runner'))]\n"
        "print(sorted(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout
