"""Turning the CPU kernels on for an engine, and the words its load log says about them.

The kernels are process-wide (the attention and layer functions look them up
per call): a bfloat16 runner on the CPU enables them once, and so does a float32
runner that is not exact; that one also opens the float32 scope around each step
(float32_scope), since an exact engine of the same process must keep torch's ops.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from kvserve.model.cpu_kernels import attention, layer_ops
from kvserve.model.cpu_kernels.float32_scope import float32_kernels


@dataclass(frozen=True, slots=True)
class CpuKernels:
    """What a runner's steps run: its load log's words, and whether its float32 steps take
    the kernels."""

    words: str = ""
    float32: bool = False

    def scope(self) -> AbstractContextManager[None]:
        """Around a step: the float32 kernels on for this runner's steps (off otherwise)."""
        return float32_kernels(self.float32)


def enable_cpu_kernels(dtype: torch.dtype, exact: bool) -> CpuKernels:
    """Enable the kernels for an engine of `dtype` on the CPU (`exact`: float32 keeps
    torch's ops)."""
    if dtype != torch.bfloat16 and (dtype != torch.float32 or exact):
        return CpuKernels()
    results = [attention.enable(), layer_ops.enable()]
    missing = [r.reason for r in results if r.path is None]
    if missing:
        return CpuKernels(f", torch's ops only ({missing[0]})")
    seconds = sum(r.seconds for r in results)
    how = f"built in {seconds:.1f} s" if seconds else "cached"
    words = f", C kernels for decode attention and the layers' small ops ({how})"
    return CpuKernels(words, dtype == torch.float32)
