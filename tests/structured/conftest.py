"""Grammar fixtures: the demo checkpoint's tokenizer (a real byte-level BPE)."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def demo_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from kvserve.model.checkpoint.tokenizer import load_tokenizer
    from kvserve.model.demo import ensure_demo_model

    return load_tokenizer(ensure_demo_model(tmp_path_factory.mktemp("demo")))
