"""Turning the CPU kernels on for an engine, and the words its load log says about them.

The kernels are process-wide (the attention and layer functions look them up
per call): a bfloat16 runner on the CPU enables them once; float32 never does
(its exact mode must keep torch's ops).
"""

from __future__ import annotations

import torch

from kvserve.model.cpu_kernels import attention, layer_ops


def enable_for(dtype: torch.dtype) -> str:
    """Enable the kernels for an engine of `dtype` on the CPU; the load log's words."""
    if dtype != torch.bfloat16:
        return ""
    results = [attention.enable(), layer_ops.enable()]
    missing = [r.reason for r in results if r.path is None]
    if missing:
        return f", torch's ops only ({missing[0]})"
    seconds = sum(r.seconds for r in results)
    how = f"built in {seconds:.1f} s" if seconds else "cached"
    return f", C kernels for decode attention and the layers' small ops ({how})"
