"""Checkpoints the command-line tests share."""

from __future__ import annotations

import pytest

from kvserve.model.demo import ensure_demo_model


@pytest.fixture(scope="session")
def demo_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The demo checkpoint (random weights, a real tokenizer and chat template)."""
    return ensure_demo_model(tmp_path_factory.mktemp("demo"))
