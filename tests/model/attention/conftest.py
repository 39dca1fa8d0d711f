"""Fixtures of the model room's tests."""

from __future__ import annotations

import pytest

from kvserve.model.cpu_kernels import attention
from tests.model.attention.backend_oracle import Reference, tiny_llama


@pytest.fixture(scope="session")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """A tiny Llama with the backend tests' head layout (built once)."""
    return tiny_llama(tmp_path_factory)


@pytest.fixture(autouse=True)
def torch_decode_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are of the torch backends' own paths and groups: the CPU's decode kernel
    (process-wide, on once a bfloat16 runner in this worker enabled it) stays off here;
    tests/model/cpu_kernels tests it."""
    monkeypatch.setattr(attention, "_kernel", None)
