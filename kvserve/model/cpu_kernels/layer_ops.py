"""A decoder layer's small ops (RMSNorm with its residual add, the rotary embedding,
SiLU-and-multiply) as one C call each, on the CPU, for bfloat16 and float32.

A decode step of a small model is mostly the dispatch of its small ops: torch
runs an RMSNorm as eight of them, the rotary embedding as four, the gated
activation as three, each costing a few microseconds over a few thousand
numbers. `layer_ops.c` computes the same arithmetic with the same roundings to
bfloat16 in the same places (float32 between them), so the bits agree with
torch's up to the order of a float32 sum (RMSNorm's mean) and the exp of SiLU
(glibc's vector exp against torch's): a rare last-bit difference of a
bfloat16. float32 runs the same ops without the roundings, only inside a fast float32
runner's step (float32_scope): the exact mode keeps torch's ops and their bits.

Enabled, like the decode attention kernel, once by a bfloat16 or fast float32 runner
on the CPU; `ops()` is None until then and wherever it cannot be built.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from kvserve.model.cpu_kernels.build import (
    FLOAT,
    INT,
    INT64,
    POINTER,
    Built,
    address,
    function,
    load,
)
from kvserve.model.cpu_kernels.float32_scope import float32_on

SOURCE = Path(__file__).with_name("layer_ops.c")

_P, _I, _L, _F = POINTER, INT, INT64, FLOAT
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


def _kernel_dtype(dtype: torch.dtype) -> bool:
    """bfloat16, or float32 inside a fast float32 runner's step."""
    return dtype == torch.bfloat16 or (dtype == torch.float32 and float32_on())


class LayerOps:
    """The loaded library's three functions per dtype, and what each accepts."""

    def __init__(self, library: ctypes.CDLL) -> None:
        def per_dtype(name: str, *args: type) -> dict[torch.dtype, Any]:
            return {t: function(library, f"{name}_{s}", None, *args) for t, s in _SUFFIX.items()}

        self._norm = per_dtype("add_rms_norm", _P, _P, _P, _P, _L, _I, _F, _I)
        self._rotary = per_dtype("rotary", _P, _L, _P, _P, _P, _L, _I, _I, _I)
        self._silu_mul = per_dtype("silu_mul", _P, _P, _L, _I, _I)

    def addresses(self, dtype: torch.dtype) -> tuple[int, int, int]:
        """The C addresses of the norm, the rotary and SiLU-and-multiply for `dtype`
        (decode_layers.c calls them)."""
        return (
            address(self._norm[dtype]),
            address(self._rotary[dtype]),
            address(self._silu_mul[dtype]),
        )

    @staticmethod
    def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether `rms_norm` computes this norm: contiguous rows of a kernel dtype on the
        CPU, the weight of the same dtype."""
        return (
            _kernel_dtype(x.dtype)
            and weight.dtype == x.dtype
            and x.device.type == "cpu"
            and x.is_contiguous()
            and weight.is_contiguous()
            and x.shape[-1] == weight.shape[0]
        )

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None
    ) -> torch.Tensor:
        """weight * (x / rms(x)) over the last dim (the quotient rounded to the dtype, as
        transformers rounds it), after x += delta in place."""
        out = torch.empty_like(x)
        if delta is not None:
            if delta.shape != x.shape or delta.dtype != x.dtype:
                raise ValueError(f"a residual of {tuple(delta.shape)} for x of {tuple(x.shape)}")
            delta = delta.contiguous()
        dim = x.shape[-1]
        self._norm[x.dtype](
            x.data_ptr(),
            None if delta is None else delta.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            x.numel() // dim,
            dim,
            eps,
            torch.get_num_threads(),
        )
        return out

    @staticmethod
    def rotates(x: torch.Tensor, cos: torch.Tensor) -> bool:
        """Whether `rotary` computes this rotation: [T, heads, dim] rows of a kernel dtype
        (any row stride) and whole-head [T, 1, dim] tables of the same dtype."""
        return (
            _kernel_dtype(x.dtype)
            and cos.dtype == x.dtype
            and x.device.type == "cpu"
            and x.dim() == 3
            and x.stride(2) == 1
            and x.stride(1) == x.shape[2]
            and cos.shape == (x.shape[0], 1, x.shape[2])
            and cos.is_contiguous()
            and x.shape[2] % 2 == 0
        )

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """x * cos + rotate_half(x) * sin, [T, heads, dim] (a new contiguous tensor)."""
        rows, heads, dim = x.shape
        out = torch.empty(rows, heads, dim, dtype=x.dtype)
        sin = signed_sin.contiguous()
        self._rotary[x.dtype](
            x.data_ptr(),
            x.stride(0),
            cos.data_ptr(),
            sin.data_ptr(),
            out.data_ptr(),
            rows,
            heads,
            dim,
            torch.get_num_threads(),
        )
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of [..., 2 * width] = [gate | up] (bfloat16: silu rounded first);
        None when the tensor is not contiguous, of a kernel dtype, on the CPU."""
        dtype = gate_up.dtype
        if not _kernel_dtype(dtype) or gate_up.device.type != "cpu" or not gate_up.is_contiguous():
            return None
        width = gate_up.shape[-1] // 2
        out = torch.empty(*gate_up.shape[:-1], width, dtype=dtype)
        self._silu_mul[dtype](
            gate_up.data_ptr(),
            out.data_ptr(),
            gate_up.numel() // (2 * width),
            width,
            torch.get_num_threads(),
        )
        return out


_ops: LayerOps | None = None
_built: Built | None = None


def ops() -> LayerOps | None:
    """The process's layer ops once `enable()` loaded them; None otherwise."""
    return _ops


def enable() -> Built:
    """Build or load the library (once per process; later calls return the first result)."""
    global _ops, _built
    if _built is None:
        library, _built = load(SOURCE)
        _ops = None if library is None else LayerOps(library)
    return _built
