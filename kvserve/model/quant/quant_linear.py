"""Linear layers with packed int8 or int4 weights, run by torch's own CPU kernels.

- int8: one symmetric scale per output channel; `torch._weight_int8pack_mm(x [M, K],
  weight int8 [N, K], scales [N])` computes x @ (weight * scales[:, None]).T.
  K must be a multiple of 16: otherwise torch 2.13's bfloat16 kernel returns
  garbage for one row and crashes the process for several.
- int4: one scale and one zero per group of `group_size` input columns;
  `torch.ops.aten._weight_int4pack_mm_for_cpu(x [M, K], packed uint8 [N, K/2], group,
  scales_and_zeros [K/group, N, 2])` dequantizes code q in 0..15 as
  (q - 8) * scale + zero. Its limits (torch 2.13): N a multiple of 16, group
  32, 64, 128 or 256, K a multiple of the group.

Both kernels want x 2-D, contiguous, and of the scales' dtype, and both are
vectorized only for bfloat16 on the CPU: float32 and float16 inputs take a
reference path 15-40 times slower than the float32 matmul they replace. So a
layer keeps its scales in its `compute_dtype` (bfloat16 in the engine, float32
where a test checks a weight bit for bit), casts its input to it and its output
back. The weights here are what the kernels see; `dequantized()` rebuilds them
in float32 through the kernel itself (the tests' reference).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

INT4_GROUP_SIZES = (32, 64, 128, 256)
"""The group sizes the CPU int4 kernel accepts."""
INT4_ROWS = 16
"""The CPU int4 packing wants the output rows in multiples of this."""
INT8_COLUMNS = 16
"""The CPU int8 kernel runs only input widths that are multiples of this."""
INT4_STACK_ROWS = 64
"""The CPU int4 packing's block of rows (64 with AVX-512, 32 with AVX2 or none): a packed
weight whose rows fill whole blocks can be followed by another's rows as they are."""
INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default
"""The kernel's overload, resolved once (the op packet resolves it on every call)."""


def int8_fits(in_features: int) -> bool:
    """Whether the CPU int8 kernel can run a weight with this many input columns."""
    return in_features % INT8_COLUMNS == 0


def int4_fits(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether the CPU int4 kernel can run a weight of this shape with this group size."""
    return (
        group_size in INT4_GROUP_SIZES
        and out_features % INT4_ROWS == 0
        and in_features % group_size == 0
    )


class PackedLinear(nn.Module):
    """What the two packed layers share: shape, bias, the dtype casts around the kernel."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: torch.Tensor | None,
        compute_dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.compute_dtype: torch.dtype = compute_dtype
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self.forward(x.reshape(-1, self.in_features)).view(*x.shape[:-1], -1)
        out = self.matmul(x.to(self.compute_dtype).contiguous()).to(x.dtype)
        return out if self.bias is None else out.add_(self.bias)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def layout(self) -> tuple:
        """What layers stacked into one must share."""
        return (type(self), self.in_features, self.compute_dtype, self.bias is None)

    def dequantized(self) -> torch.Tensor:
        """The weight [N, K] the kernel multiplies by, in float32 (one product with I)."""
        eye = torch.eye(self.in_features, dtype=self.compute_dtype, device=self.device)
        return self.matmul(eye).t().float()

    @property
    def device(self) -> torch.device:
        raise NotImplementedError

    def extra_repr(self) -> str:
        dtype = str(self.compute_dtype).removeprefix("torch.")
        return f"in={self.in_features}, out={self.out_features}, compute={dtype}"


class Int8Linear(PackedLinear):
    """Per-output-channel symmetric int8: w ~= weight[n, k] * scales[n]."""

    weight_int8: torch.Tensor  # buffers (register_buffer)
    scales: torch.Tensor

    def __init__(
        self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
    ) -> None:
        out_features, in_features = weight.shape
        if not int8_fits(in_features):
            raise ValueError(
                f"int8 cannot run a weight of {in_features} columns (a multiple of "
                f"{INT8_COLUMNS} is needed)"
            )
        super().__init__(in_features, out_features, bias, scales.dtype)
        self.register_buffer("weight_int8", weight, persistent=False)
        self.register_buffer("scales", scales, persistent=False)

    @classmethod
    def quantize(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, compute_dtype: torch.dtype
    ) -> Int8Linear:
        """Round each row to 255 levels around 0; its scale maps the row's largest |w| to 127."""
        w = weight.detach().float()
        absmax = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny)
        scales = (absmax / 127).to(compute_dtype)
        q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q, scales, bias)

    @classmethod
    def stacked(cls, parts: list[Int8Linear]) -> Int8Linear | None:
        """One layer computing all of `parts` on the same input (rows and their scales
        stacked), or None where their widths, compute dtypes or biases disagree."""
        if not same_layout(parts):
            return None
        weight = torch.cat([p.weight_int8 for p in parts])
        return cls(weight, torch.cat([p.scales for p in parts]), stacked_bias(parts))

    @property
    def device(self) -> torch.device:
        return self.weight_int8.device

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, self.weight_int8, self.scales)


class Int4Linear(PackedLinear):
    """Group-wise asymmetric int4: w ~= (q - 8) * scale + zero, per group of input columns."""

    packed: torch.Tensor  # buffers (register_buffer)
    scales_and_zeros: torch.Tensor

    def __init__(
        self,
        packed: torch.Tensor,
        scales_and_zeros: torch.Tensor,
        bias: torch.Tensor | None,
        group_size: int,
    ) -> None:
        """`packed`: the codes in the kernel's layout ([N, K/2] uint8, from `from_codes`);
        `scales_and_zeros` [K / group_size, N, 2], in the dtype the layer computes in."""
        out_features, in_features = packed.shape[0], packed.shape[1] * 2
        super().__init__(in_features, out_features, bias, scales_and_zeros.dtype)
        self.group_size = group_size
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales_and_zeros", scales_and_zeros, persistent=False)

    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        bias: torch.Tensor | None,
        group_size: int,
    ) -> Int4Linear:
        """`codes` int32 [N, K] in 0..15; `scales` and `zeros` [N, K / group_size], in the
        dtype the layer computes in."""
        out_features, in_features = codes.shape
        if not int4_fits(out_features, in_features, group_size):
            raise ValueError(
                f"int4 cannot pack a {out_features}x{in_features} weight in groups of "
                f"{group_size} (rows a multiple of {INT4_ROWS}, group one of "
                f"{INT4_GROUP_SIZES} dividing the columns)"
            )
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
        pairs = torch.stack((scales, zeros), dim=-1).transpose(0, 1).contiguous()
        return cls(packed, pairs, bias, group_size)

    @classmethod
    def stacked(cls, parts: list[Int4Linear]) -> Int4Linear | None:
        """One layer computing all of `parts` on the same input (rows stacked), or None
        where the packed layout does not allow it: the CPU packing stores rows in blocks
        of INT4_STACK_ROWS (fewer without AVX-512), so every part but the last must fill
        whole blocks; groups and compute dtypes must agree."""
        if not same_layout(parts) or any(p.out_features % INT4_STACK_ROWS for p in parts[:-1]):
            return None
        return cls(
            torch.cat([p.packed for p in parts]),
            torch.cat([p.scales_and_zeros for p in parts], dim=1),
            stacked_bias(parts),
            parts[0].group_size,
        )

    @classmethod
    def quantize(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group_size: int,
        compute_dtype: torch.dtype,
    ) -> Int4Linear:
        """Each group's range [min, max] in 16 levels (scale and zero rounded to the compute
        dtype first, so the codes are chosen against the values the kernel will use)."""
        w = weight.detach().float()
        out_features, in_features = w.shape
        groups = w.view(out_features, in_features // group_size, group_size)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scales = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        scales = scales.to(compute_dtype)
        zeros = (low + 8 * scales.float()).to(compute_dtype)
        q = torch.round((groups - zeros.float()[..., None]) / scales.float()[..., None]) + 8
        codes = q.clamp(0, 15).to(torch.int32).view(out_features, in_features)
        return cls.from_codes(codes, scales, zeros, bias, group_size)

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return INT4_MM(x, self.packed, self.group_size, self.scales_and_zeros)

    def layout(self) -> tuple:
        return (*super().layout(), self.group_size)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group={self.group_size}"


def same_layout(parts: Sequence[PackedLinear]) -> bool:
    """Whether packed layers can be stacked into one: the same kind, input width, compute
    dtype and group, and a bias on all or none."""
    return len({p.layout() for p in parts}) == 1


def stacked_bias(parts: Sequence[nn.Linear | PackedLinear]) -> torch.Tensor | None:
    """The biases of layers whose rows are stacked (all of them have one, or none)."""
    biases = [p.bias for p in parts]
    if biases[0] is None:
        return None
    return torch.cat([b.detach() for b in biases if b is not None])


def packed_bytes(module: nn.Module) -> int:
    """Bytes the packed layers of `module` hold (weights, scales, zeros, biases)."""
    return sum(
        t.numel() * t.element_size()
        for m in module.modules()
        if isinstance(m, PackedLinear)
        for t in (*m.buffers(recurse=False), *m.parameters(recurse=False))
    )
