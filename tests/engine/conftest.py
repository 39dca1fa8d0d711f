"""Engine fixtures: the demo checkpoint, whose byte-level BPE tokenizer splits
multi-byte UTF-8 characters over tokens (its random weights sample such tokens)."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from kvserve.model.demo import ensure_demo_model

    return ensure_demo_model(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="session")
def demo_tokenizer(demo_model: str) -> Any:
    """The transformers tokenizer of the demo checkpoint, as the engine loads it."""
    from kvserve.model.checkpoint.tokenizer import load_tokenizer

    return load_tokenizer(demo_model)


@pytest.fixture(scope="session")
def moe_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tiny mixture-of-experts checkpoints (tests/model/moe_checkpoints.py), by family."""
    from tests.model.moe_checkpoints import MOE_ARCHS, moe_checkpoint

    return {arch: moe_checkpoint(tmp_path_factory, arch) for arch in MOE_ARCHS}
