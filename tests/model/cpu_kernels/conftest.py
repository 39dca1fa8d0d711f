"""The CPU kernels built once per test session into a private cache, each as this machine
builds it and as a machine without AVX-512 would (its plain C loops)."""

from __future__ import annotations

import ctypes
import platform
from pathlib import Path

import pytest

from kvserve.model.cpu_kernels import attention, layer_ops
from kvserve.model.cpu_kernels.attention import AttentionKernel
from kvserve.model.cpu_kernels.build import build
from kvserve.model.cpu_kernels.layer_ops import LayerOps

PORTABLE = ("-mno-avx512f",) if platform.machine() in ("x86_64", "AMD64") else ()
"""Flags that turn the kernels' vector paths off."""


@pytest.fixture(scope="session")
def kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kernels")


def library(variant: str, cache: Path, source: Path) -> ctypes.CDLL:
    """`source` built in `variant` ("native" or "portable") into `cache`, or a skip."""
    if variant == "portable" and not PORTABLE:
        pytest.skip("the native build is the portable one on this machine")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVSERVE_KERNEL_CACHE", str(cache))
        built = build(source, PORTABLE if variant == "portable" else ())
    if built.path is None:
        pytest.skip(f"no kernel here: {built.reason}")
    return ctypes.CDLL(str(built.path))


@pytest.fixture(scope="session", params=["native", "portable"])
def attention_kernel(request, kernel_cache) -> AttentionKernel:
    return AttentionKernel(library(request.param, kernel_cache, attention.SOURCE))


@pytest.fixture(scope="session", params=["native", "portable"])
def fused(request, kernel_cache) -> LayerOps:
    return LayerOps(library(request.param, kernel_cache, layer_ops.SOURCE))
