"""The CPU kernels built once per test session into a private cache."""

from __future__ import annotations

import platform

import pytest

from kvserve.model.cpu_kernels.build import build
from kvserve.model.cpu_kernels.decode_attention import SOURCE, DecodeAttentionKernel

PORTABLE = ("-mno-avx512f",) if platform.machine() in ("x86_64", "AMD64") else ()
"""Flags that turn the kernel's vector path off: its plain C loops are what a machine
without AVX-512 runs."""


@pytest.fixture(scope="session")
def kernel_cache(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture(scope="session", params=["native", "portable"])
def decode_kernel(request, kernel_cache) -> DecodeAttentionKernel:
    """The decode attention kernel as this machine builds it, and its plain C variant."""
    if request.param == "portable" and not PORTABLE:
        pytest.skip("the native build is the portable one on this machine")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVSERVE_KERNEL_CACHE", str(kernel_cache))
        built = build(SOURCE, PORTABLE if request.param == "portable" else ())
    if built.path is None:
        pytest.skip(f"no kernel here: {built.reason}")
    return DecodeAttentionKernel(built.path)
