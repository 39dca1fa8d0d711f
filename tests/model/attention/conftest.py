"""Fixtures of the model room's tests."""

from __future__ import annotations

import pytest

from tests.model.attention.backend_oracle import Reference, tiny_llama


@pytest.fixture(scope="session")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """A tiny Llama with the backend tests' head layout (built once)."""
    return tiny_llama(tmp_path_factory)
