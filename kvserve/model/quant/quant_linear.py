"""Linear layers with packed 8-bit or 4-bit weights, run by kvserve's C kernel
(kvserve.model.cpu_kernels.quant_matmul): int8 activations in blocks of 32 times the
packed codes, integer dot products on VNNI or AVX2.

- int8: one symmetric float32 scale per output row, w ~= (code - 128) * scale.
- int4: one scale and one offset per block of 32 input columns,
  w ~= code * scale + offset with code 0..15; float16 where that holds the
  values exactly (kvserve's own quantizer, GGUF's Q4_0 and Q4_1), float32
  otherwise (Q4_K's products of two scales). No offsets stored means
  offset = -8 * scale (Q4_0's symmetric blocks): 18 bytes per 32 weights, as
  the GGUF file.

The kernel reads x in float32 or bfloat16 and writes the same dtype, so a
layer computes in its engine's dtype; the weights' only rounding is the codes'
and the activations' int8 (llama.cpp's Q8_0 for the input: a relative 1/254 of
each block's largest value). On a CPU with AMX, calls of the kernel's `tile_rows`
rows or more run on its tiles in bfloat16 instead (the weights dequantized 16 rows
at a time). Below `dense_rows` rows (DENSE_ROWS; more in float32 for long rows on
AVX-512 VNNI) a row's result never depends on the rows beside it within each of those
two paths; from there the weight is dequantized once and the input keeps its float
values (a prefill of many tokens).
Where the kernel cannot be built (no C compiler, or KVSERVE_CPU_KERNELS=0), a layer
dequantizes its weight on each call: the same weights, float activations, slow.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from functools import cache
from typing import ClassVar

import torch
from torch import nn

from kvserve.model.cpu_kernels import quant_matmul
from kvserve.model.cpu_kernels.quant_layout import (
    BLOCK,
    CHUNK,
    check_width,
    fits,
    pack,
    packed_columns,
    unpack,
)

__all__ = ["BLOCK", "CHUNK", "Int4Linear", "Int8Linear", "PackedLinear", "fits"]

DENSE_ROWS = {torch.bfloat16: 64, torch.float32: 128}
"""From this many input rows (a prefill's chunk, a large batch) a layer dequantizes its
weight once, in its packed column order, and runs the dtype's own matmul (oneDNN, AMX
where present) on the input's columns in that order: the integer kernel is bound by its
multiply-adds there, a float matmul library far less. Measured on the default model's
layers (docs/quantization.md): 1,000 rows in bfloat16 take 0.3x the integer kernel's
time, in float32 0.7x; the crossings are near these counts."""
DENSE_ROWS_ON_TILES = {torch.bfloat16: 2048, torch.float32: 1 << 62}
"""The same where the kernel runs many rows on AMX tiles (its tile_rows): a 1B model's
layers took 0.24-0.87x the dense path's time up to 1,024 rows in bfloat16 (2,048: 1.0x)
and 0.11-0.32x at every count measured in float32 (the dense float32 matmul has no
tiles)."""


DENSE_ROWS_LONG_FLOAT32 = 2048
"""float32 on AVX-512 VNNI without tiles, layers of long rows (`long_rows`): the integer
kernel stays faster far beyond DENSE_ROWS. On an AMD EPYC (Zen 4, 2 threads) a 1B model's
layers (2,048 and 8,192 columns) took 0.22x the dense float32 path's time at 64 rows, 0.50x
at 1,000, 0.63x at 2,048 and 0.85x at 4,096; Qwen2.5-0.5B's shapes (896 and 4,864) 0.68x at
128 rows and 0.95x at 2,048. The default model's (576 columns: a window of 2 blocks after
one of 16, run as a whole one) crossed near 300 rows, so short rows keep DENSE_ROWS."""


def long_rows(in_features: int) -> bool:
    """Whether the kernel's windows of 512 columns are at least 7/8 full over a row: its
    last window, however short, costs about a whole one."""
    windows = -(-in_features // 512)
    return in_features * 8 >= windows * 512 * 7


def dense_rows(dtype: torch.dtype, in_features: int) -> int:
    """Input rows from which a packed layer of `dtype` with `in_features` columns takes the
    dense path."""
    kernel = quant_matmul.kernel()
    if kernel is not None and kernel.tile_rows:
        return DENSE_ROWS_ON_TILES[dtype]
    if (
        dtype == torch.float32
        and kernel is not None
        and kernel.path == "avx512-vnni"
        and long_rows(in_features)
    ):
        return DENSE_ROWS_LONG_FLOAT32
    return DENSE_ROWS[dtype]


class _Scratch(threading.local):
    """Per thread (engines stepping in threads of one process), per dtype: one dequantized
    weight at a time, reused (a fresh one per call pays the page faults of its first touch)."""

    def __init__(self) -> None:
        self.by_dtype: dict[torch.dtype, torch.Tensor] = {}


_scratch = _Scratch()


class PackedLinear(nn.Module):
    """What the two packed layers share: the codes and scales, the bias, the kernel call."""

    bits: ClassVar[int]
    codes: torch.Tensor  # buffers (register_buffer)
    scales: torch.Tensor
    offsets: torch.Tensor | None

    def __init__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        offsets: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> None:
        """`codes`: the kernel's packed rows (quant_layout.pack)."""
        super().__init__()
        self.in_features = codes.shape[1] * 8 // self.bits
        self.out_features = codes.shape[0]
        check_width(self.in_features)
        self.register_buffer("codes", codes, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.register_buffer("offsets", offsets, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        quant_matmul.enable()  # once per process; cached on disk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self.forward(x.reshape(-1, self.in_features)).view(*x.shape[:-1], -1)
        kernel = quant_matmul.kernel()
        dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16) else torch.float32
        if kernel is None or x.device.type != "cpu":
            out = nn.functional.linear(x.float(), self.dequantized().to(x.device)).to(x.dtype)
        elif x.shape[0] >= dense_rows(dtype, self.in_features):
            size = self.out_features * self.in_features
            buffer = _scratch.by_dtype.get(dtype)
            if buffer is None or buffer.numel() < size:
                buffer = _scratch.by_dtype[dtype] = torch.empty(size, dtype=dtype)
            weight = buffer[:size].view(self.out_features, self.in_features)
            kernel.dequantize(self.codes, self.scales, self.offsets, weight)
            columns = x.to(dtype).index_select(1, _columns(self.in_features))
            out = nn.functional.linear(columns, weight).to(x.dtype)
        else:
            out = kernel(x.to(dtype).contiguous(), self.codes, self.scales, self.offsets)
            out = out.to(x.dtype)
        return out if self.bias is None else out.add_(self.bias)

    def layout(self) -> tuple:
        """What layers stacked into one must share."""
        return (
            type(self),
            self.in_features,
            self.scales.dtype,
            self.offsets is None,
            self.bias is None,
        )

    @classmethod
    def stacked(cls, parts: Sequence[PackedLinear]) -> PackedLinear | None:
        """One layer computing all of `parts` on the same input (their rows, scales and
        offsets stacked), or None where their widths, scales or biases disagree."""
        if len({p.layout() for p in parts}) != 1:
            return None
        offsets = [p.offsets for p in parts if p.offsets is not None]
        return cls(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scales for p in parts]),
            torch.cat(offsets) if offsets else None,
            stacked_bias(parts),
        )

    def dequantized(self) -> torch.Tensor:
        """The weight [N, K] the codes stand for, in float32."""
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def extra_repr(self) -> str:
        scales = str(self.scales.dtype).removeprefix("torch.")
        return f"in={self.in_features}, out={self.out_features}, scales={scales}"


class Int8Linear(PackedLinear):
    """Per-output-row symmetric int8: w ~= (code - 128) * scales[n]."""

    bits = 8

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Int8Linear:
        """Round each row to 255 levels around 0; its scale maps the row's largest |w| to 127."""
        w = weight.detach().float()
        scales = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
        q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int32)
        return cls(pack(q + 128, 8), scales, None, bias)

    def dequantized(self) -> torch.Tensor:
        codes = unpack(self.codes.cpu(), self.in_features, 8) - 128
        return codes.float() * self.scales.cpu().float()[:, None]


class Int4Linear(PackedLinear):
    """Blocks of 32 input columns: w ~= code * scale + offset, code 0..15."""

    bits = 4

    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,
        scales: torch.Tensor,
        offsets: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> Int4Linear:
        """`codes` [N, K] in 0..15; `scales` and `offsets` [N, K / 32], float16 or float32
        (offsets None: -8 * scales)."""
        return cls(pack(codes, 4), scales.contiguous(), offsets, bias)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Int4Linear:
        """Each block's range [min, max] in 16 levels, scale and offset in float16: the scale
        rounded up and the offset down, so the levels still span the range, and the codes
        chosen against the rounded values."""
        w = weight.detach().float()
        out_features, in_features = w.shape
        check_width(in_features)
        blocks = w.view(out_features, in_features // BLOCK, BLOCK)
        low, high = blocks.amin(dim=-1), blocks.amax(dim=-1)
        tiny = torch.finfo(torch.float16).tiny
        scales = ((high - low) / 15 * (1 + 2**-10)).clamp(min=tiny).half()
        offsets = (low - low.abs() * 2**-10).half()
        q = torch.round((blocks - offsets.float()[..., None]) / scales.float()[..., None])
        codes = q.clamp(0, 15).to(torch.int32).view(out_features, in_features)
        return cls.from_codes(codes, scales, offsets, bias)

    def dequantized(self) -> torch.Tensor:
        codes = unpack(self.codes.cpu(), self.in_features, 4).float()
        scales = self.scales.cpu().float()
        offsets = -8 * scales if self.offsets is None else self.offsets.cpu().float()
        per_column = codes.view(self.out_features, -1, BLOCK) * scales[..., None]
        return (per_column + offsets[..., None]).view(self.out_features, self.in_features)


@cache
def _columns(in_features: int) -> torch.Tensor:
    return packed_columns(in_features)


def stacked_bias(parts: Sequence[nn.Linear | PackedLinear]) -> torch.Tensor | None:
    """The biases of layers whose rows are stacked (all of them have one, or none)."""
    biases = [p.bias for p in parts]
    if biases[0] is None:
        return None
    return torch.cat([b.detach() for b in biases if b is not None])


def packed_bytes(module: nn.Module) -> int:
    """Bytes the packed layers of `module` hold (codes, scales, offsets, biases)."""
    return sum(
        t.numel() * t.element_size()
        for m in module.modules()
        if isinstance(m, PackedLinear)
        for t in (*m.buffers(recurse=False), *m.parameters(recurse=False))
    )
