"""A decode step's layers in one C call (`decode_layers.c`): the ctypes side.

The C file says why (the Python between a 1B model's kernels costs about a fifth of a
decode step) and what it runs: the other libraries' kernels, through their addresses,
so the numbers are those of the Python path. This module holds the plain structs the
call takes (the weights' pointers, built once per model by
kvserve.model.fused_decode; the step's shapes and cache slots, built per step)
and loads the library once per process.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.autograd.profiler as profiler

from kvserve.model.cpu_kernels import attention, layer_ops, quant_matmul
from kvserve.model.cpu_kernels.build import INT, INT64, POINTER, Built, function, load

SOURCE = Path(__file__).with_name("decode_layers.c")

_P, _L = ctypes.c_void_p, ctypes.c_int64


class Packed(ctypes.Structure):
    """A packed projection's quant_matmul arguments and its bias (or None)."""

    _fields_ = [
        ("codes", _P),
        ("scales", _P),
        ("offsets", _P),
        ("bias", _P),
        ("out_features", _L),
        ("in_features", _L),
        ("bits", _L),
        ("scales_f16", _L),
    ]


class Layer(ctypes.Structure):
    """A decoder layer's weights."""

    _fields_ = [
        ("qkv", Packed),
        ("o", Packed),
        ("gate_up", Packed),
        ("down", Packed),
        ("input_norm", _P),
        ("post_norm", _P),
    ]


class Reads(ctypes.Structure):
    """A KV cache group's step: each row's write slot, its context's slots and bounds."""

    _fields_ = [("write_slots", _P), ("slots", _P), ("bounds", _P), ("width", _L)]


class Step(ctypes.Structure):
    """The step's rows, the model's shapes, the rotary tables, eps and the softmax scale."""

    _fields_ = [
        ("rows", _L),
        ("hidden", _L),
        ("heads", _L),
        ("kv_heads", _L),
        ("head_dim", _L),
        ("intermediate", _L),
        ("bf16", _L),
        ("threads", _L),
        ("cos", _P),
        ("signed_sin", _P),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
    ]


class Kernels(ctypes.Structure):
    """One element type's kernels, by address (in decode_layers.c's order)."""

    _fields_ = [("matmul", _P), ("norm", _P), ("rotary", _P), ("silu_mul", _P), ("attend", _P)]


class DecodeLayers:
    """The loaded `decode_layers` and, per dtype, the kernels it calls."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fn = function(library, "decode_layers", INT, POINTER, POINTER, POINTER, INT64,
                            POINTER, POINTER, POINTER)  # fmt: skip
        self._kernels: dict[torch.dtype, Kernels] = {}

    def kernels(self, dtype: torch.dtype) -> Kernels | None:
        """The kernels for `dtype`, once all three libraries are loaded; None before."""
        found = self._kernels.get(dtype)
        if found is not None:
            return found
        matmul, ops, attend = quant_matmul.kernel(), layer_ops.ops(), attention.kernel()
        if matmul is None or ops is None or attend is None:
            return None
        norm, rotary, silu_mul = ops.addresses(dtype)
        found = Kernels(
            matmul.function_address, norm, rotary, silu_mul, attend.decode_address(dtype)
        )
        self._kernels[dtype] = found
        return found

    def __call__(
        self,
        kernels: Kernels,
        step: Step,
        layers: ctypes.Array[Layer],
        caches: ctypes.Array[ctypes.c_void_p],
        reads: ctypes.Array[ctypes.c_void_p],
        x: torch.Tensor,
    ) -> None:
        """Run every layer on the residual stream x in place."""
        args = (
            ctypes.byref(kernels),
            ctypes.byref(step),
            layers,
            len(layers),
            caches,
            reads,
            x.data_ptr(),
        )
        if profiler._is_profiler_enabled:  # seen by torch's profiler (benchmarks/profile_step)
            with torch.profiler.record_function("kvserve::decode_layers"):
                status = self._fn(*args)
        else:
            status = self._fn(*args)
        if status != 0:
            what = "out of memory" if status == -2 else "a kernel refused its shapes"
            raise RuntimeError(f"decode_layers: {what} ({step.rows} rows, {len(layers)} layers)")


_kernel: DecodeLayers | None = None
_built: Built | None = None


def kernel() -> DecodeLayers | None:
    """The process's library once `enable()` loaded it; None otherwise."""
    return _kernel


def enable() -> Built:
    """Build or load the library (once per process; later calls return the first result)."""
    global _kernel, _built
    if _built is None:
        library, _built = load(SOURCE)
        _kernel = None if library is None else DecodeLayers(library)
    return _built
