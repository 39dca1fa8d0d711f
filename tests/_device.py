"""The device of the device tests: CUDA where torch sees a GPU, else skipped.

`KVSERVE_TEST_DEVICE=cpu` (or `cuda:1`, ...) runs them on that device instead,
so the same test code can be run, and shown to work, on a machine without a GPU.
The default suite on a CPU-only machine skips them at collection: no cost.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

DEVICE: str | None = os.environ.get("KVSERVE_TEST_DEVICE") or (
    "cuda" if torch.cuda.is_available() else None
)

needs_device = pytest.mark.skipif(
    DEVICE is None, reason="no CUDA GPU (KVSERVE_TEST_DEVICE=cpu runs these tests on the CPU)"
)


def _tf32_flags() -> list[tuple[object, str, object]]:
    """(holder, attribute, exact value) of the settings that let float32 run as TF32."""
    cuda, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    if hasattr(cuda, "fp32_precision"):  # torch >= 2.9: mixing in the legacy flags is an error
        return [(cuda, "fp32_precision", "ieee"), (cudnn.conv, "fp32_precision", "ieee")]
    return [(cuda, "allow_tf32", False), (cudnn, "allow_tf32", False)]


@pytest.fixture
def exact_float32() -> Iterator[None]:
    """float32 as float32 (cuDNN convolutions, Bamba's among them, default to TF32 on
    Ampere and later): the oracle tests compare greedy tokens with the CPU's."""
    flags = _tf32_flags()
    saved = [getattr(holder, name) for holder, name, _ in flags]
    for holder, name, exact in flags:
        setattr(holder, name, exact)
    yield
    for (holder, name, _), value in zip(flags, saved, strict=True):
        setattr(holder, name, value)
