"""4-bit and 8-bit weight matmuls on the CPU in C (`quant_matmul.c`), with int8 activations.

torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`) dequantizes its weights
to bfloat16 and multiplies in floating point: on one decode row it streams a
1B model's 4-bit weights at about half the machine's copy bandwidth, and its
int8 kernel does the same with 8-bit ones. A decode step reads every weight
once, so the weights' bytes per second is the speed. `quant_matmul.c` does
what llama.cpp does instead: each 32-wide block of an input row becomes int8
with one float scale, each block's dot product is an integer one on VNNI
(AVX-512 or AVX-VNNI) or AVX2, and one float multiply-add per block scales it.
No library ships such a kernel for a plain shared library with these layouts
(llama.cpp's ggml is a whole runtime with its own tensors and threads), so it
is written here, in about 300 lines of C.

On a CPU with AMX (Sapphire Rapids and later) a call of `tile_rows` input rows
or more (a prefill's chunk, a batch of 10 decodes) runs on the tiles instead
(`quant_matmul_amx.h`): 16 weight rows at a time dequantized to bfloat16, the
input rounded to bfloat16, sums in float32, about 2-3x the speed of VNNI there
(docs/quantization.md). Below `tile_rows`, and on either path, a row's result
never depends on the other rows of its call. `KVSERVE_AMX=0` keeps the tiles
off. The weights' layout is `quant_layout`'s. The tests compare the kernel with
the same sums computed in float64 by torch, on every instruction path this CPU
can build (`build_variant`: AVX-512 VNNI and AMX, AVX2 with and without VNNI,
plain C).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch
import torch.autograd.profiler as profiler

from kvserve.model.cpu_kernels.build import (
    AMX_ENV,
    INT,
    INT64,
    POINTER,
    Built,
    address,
    build,
    function,
    load,
)

SOURCE = Path(__file__).with_name("quant_matmul.c")
DEQUANTIZE_SOURCE = Path(__file__).with_name("quant_dequantize.c")

_P, _I, _L = POINTER, INT, INT64


class QuantMatmul:
    """The loaded library's `quant_matmul` and the instruction path it was built with, and
    `quant_dequantize` (its own library) for matmuls of many rows."""

    def __init__(self, library: ctypes.CDLL, dequantize_library: ctypes.CDLL) -> None:
        self._fn = function(
            library, "quant_matmul", _I, _P, _P, _I, _L, _L, _L, _P, _I, _P, _P, _I, _I
        )
        self._dequantize = function(
            dequantize_library, "quant_dequantize", None, _P, _I, _P, _P, _I, _L, _L, _P, _I, _I
        )
        path = function(library, "quant_matmul_path", ctypes.c_char_p)
        self.path: str = path().decode()
        """avx512-vnni, avx2-vnni, avx2 or portable."""
        self._tiles = function(library, "quant_matmul_tiles", _I, _I)
        self.dense_bf16: bool = bool(function(library, "quant_matmul_dense_bf16", _I)())
        """Whether `dense` runs bfloat16 panels here (AVX-512 BF16: dense_bf16.h)."""
        self.dense_f32: bool = bool(function(library, "quant_matmul_dense_f32", _I)())
        """Whether `dense` runs float32 panels here (AVX-512 or AVX2: dense_f32.h)."""
        self.tile_rows: int = self.use_tiles(os.environ.get(AMX_ENV, "1") != "0")
        """The input rows from which a call runs on AMX tiles in bfloat16; 0: never."""

    def use_tiles(self, on: bool) -> int:
        """AMX tiles on or off for this library's calls (tests, benchmarks): the new
        tile_rows. On asks Linux for the tiles' state; without AMX it stays 0."""
        self.tile_rows = self._tiles(int(on))
        return self.tile_rows

    @property
    def function_address(self) -> int:
        """The C address of `quant_matmul` (decode_layers.c calls it)."""
        return address(self._fn)

    def __call__(
        self,
        x: torch.Tensor,
        codes: torch.Tensor,
        scales: torch.Tensor,
        offsets: torch.Tensor | None,
    ) -> torch.Tensor:
        """x [M, K] (float32 or bfloat16, contiguous) times the packed weight, transposed:
        [M, N] in x's dtype. `codes` [N, K/2] (4 bits) or [N, K] (8 bits) uint8."""
        rows, width = x.shape
        out_features = codes.shape[0]
        bits = 4 if codes.shape[1] * 2 == width else 8
        out = torch.empty(rows, out_features, dtype=x.dtype)
        args = (
            x.data_ptr(),
            out.data_ptr(),
            int(x.dtype == torch.bfloat16),
            rows,
            out_features,
            width,
            codes.data_ptr(),
            bits,
            scales.data_ptr(),
            None if offsets is None else offsets.data_ptr(),
            int(scales.dtype == torch.float16),
            torch.get_num_threads(),
        )
        if profiler._is_profiler_enabled:  # seen by torch's profiler (benchmarks/profile_step)
            with torch.profiler.record_function("kvserve::quant_matmul"):
                status = self._fn(*args)
        else:
            status = self._fn(*args)
        if status != 0:
            what = "out of memory" if status == -2 else f"a {tuple(x.shape)} input it cannot run"
            raise RuntimeError(f"quant_matmul: {what} (codes {tuple(codes.shape)}, {bits} bits)")
        return out

    def dense(self, x: torch.Tensor, panels: torch.Tensor, out_features: int) -> torch.Tensor:
        """x [M, K] times a bfloat16 or float32 weight [N, K] held in panels (panel_linear's
        `pack_panels`), transposed: [M, N] in the panels' dtype (x contiguous, of that
        dtype; `dense_bf16` and `dense_f32` say whether this CPU runs it)."""
        count, lines, _, width = panels.shape
        if panels.dtype not in (torch.bfloat16, torch.float32) or (
            count * 16 - out_features not in range(16)
        ):
            raise ValueError(f"dense: {panels.dtype} panels {tuple(panels.shape)} hold no "
                             f"{out_features} rows")  # fmt: skip
        if x.dtype != panels.dtype or (lines * width - x.shape[1]) not in range(width):
            raise ValueError(f"dense: a {tuple(x.shape)} {x.dtype} input for panels "
                             f"{tuple(panels.shape)}")  # fmt: skip
        out = torch.empty(x.shape[0], out_features, dtype=x.dtype)
        bf16, threads = x.dtype == torch.bfloat16, torch.get_num_threads()
        args = (x.data_ptr(), out.data_ptr(), int(bf16), x.shape[0], out_features, x.shape[1],
                panels.data_ptr(), 16 if bf16 else 32, None, None, 0, threads)  # fmt: skip
        if profiler._is_profiler_enabled:
            with torch.profiler.record_function("kvserve::dense_panels"):
                status = self._fn(*args)
        else:
            status = self._fn(*args)
        if status != 0:
            raise RuntimeError(f"quant_matmul: a {tuple(x.shape)} input it cannot run "
                               f"({panels.dtype} panels {tuple(panels.shape)})")  # fmt: skip
        return out

    def dequantize(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        offsets: torch.Tensor | None,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """The weight [N, K] into `out` (contiguous float32 or bfloat16), its columns in the
        packed order (quant_layout.packed_columns)."""
        in_features, dtype = out.shape[1], out.dtype
        with torch.profiler.record_function("kvserve::quant_dequantize"):  # once a call
            self._dequantize(
                codes.data_ptr(),
                4 if codes.shape[1] * 2 == in_features else 8,
                scales.data_ptr(),
                None if offsets is None else offsets.data_ptr(),
                int(scales.dtype == torch.float16),
                codes.shape[0],
                in_features,
                out.data_ptr(),
                int(dtype == torch.bfloat16),
                torch.get_num_threads(),
            )
        return out


_kernel: QuantMatmul | None = None
_built: Built | None = None


def kernel() -> QuantMatmul | None:
    """The process's kernel once `enable()` loaded it; None otherwise."""
    return _kernel


def enable() -> Built:
    """Build or load the library (once per process; later calls return the first result)."""
    global _kernel, _built
    if _built is None:
        library, _built = load(SOURCE)
        dequantize, built = load(DEQUANTIZE_SOURCE)
        if library is not None and dequantize is None:
            library, _built = None, built
        _kernel = (
            None if library is None or dequantize is None else QuantMatmul(library, dequantize)
        )
    return _built


def build_variant(extra_flags: tuple[str, ...]) -> QuantMatmul | None:
    """The kernel built with more flags (`-mno-avx512f` for the AVX2 path on an AVX-512
    CPU): the tests run each path this CPU can execute. None when it does not build."""
    built, dequantize = build(SOURCE, extra_flags), build(DEQUANTIZE_SOURCE, extra_flags)
    if built.path is None or dequantize.path is None:
        return None
    return QuantMatmul(ctypes.CDLL(str(built.path)), ctypes.CDLL(str(dequantize.path)))
