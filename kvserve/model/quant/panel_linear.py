"""bfloat16 and float32 linear layers on kvserve's own kernels (kvserve.model.cpu_kernels.
quant_matmul's `dense`: dense_bf16.h on AVX-512 BF16, dense_f32.h on AVX-512 or AVX2),
outside the exact mode: every call, decode steps and prefills.

Why: a decode step of the default model is a few rows through every layer, a quarter
of it or more Python between the kernels (benchmarks/profile_step.py). The fused decode
(kvserve.model.fused_decode) removes that, but it runs C kernels only, and oneDNN's
matmul is not one it can call. The weight is kept in the kernels' "panels" (sixteen
output columns with their inputs interleaved, `pack_panels`), much as oneDNN packs its
own, so no call reorders it, and one layout serves every row count: a row's bits never
depend on the size of its batch or chunk, nor (float32) on the CPU's vector width.

Numerics: float32 sums of the same products as oneDNN's, in another order, so the last
bits differ from F.linear's. The engine's exact mode keeps F.linear's bits (float32:
F.linear itself; bfloat16: OneDNNLinear, kvserve.model.quant.onednn_linear). A tied
lm_head holds its own panels (the embeddings stay rows, for the lookup).
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.engine.engine_args import exact_from_env
from kvserve.model.cpu_kernels import quant_matmul
from kvserve.model.quant.quantize import swap_float_linears

PANEL = 16
"""Output columns a panel holds (one AVX-512 vector of float32 sums)."""


def interleaved(dtype: torch.dtype) -> int:
    """Input columns a panel's line holds side by side: bfloat16's dot products take pairs."""
    return 2 if dtype == torch.bfloat16 else 1


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / 16), ceil(K / g), 16, g], g = `interleaved(dtype)`: panel p, line
    j holds w[16p + i, g j + c] at [p, j, i, c]; rows and columns past N and K are zeros."""
    n, k = weight.shape
    g = interleaved(weight.dtype)
    padded = nn.functional.pad(weight.detach(), (0, -k % g, 0, -n % PANEL))
    shape = (padded.shape[0] // PANEL, PANEL, padded.shape[1] // g, g)
    return padded.reshape(shape).permute(0, 2, 1, 3).contiguous()


def unpack_panels(panels: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """pack_panels' inverse: the weight [N, K]."""
    count, lines, _, g = panels.shape
    rows = panels.permute(0, 2, 1, 3).reshape(count * PANEL, lines * g)
    return rows[:out_features, :in_features].contiguous()


class PanelLinear(nn.Module):
    """y = x W^T + b in the weight's dtype, W in the kernel's panels (`pack_panels`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.panels = nn.Parameter(pack_panels(weight), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """The weight [N, K] as rows (a copy: for readers other than the kernel)."""
        return unpack_panels(self.panels, self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self.forward(x.reshape(-1, self.in_features)).view(*x.shape[:-1], -1)
        kernel = quant_matmul.kernel()
        if kernel is None or x.dtype != self.panels.dtype or x.device.type != "cpu":
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return nn.functional.linear(x, self.weight.to(x.dtype), bias)
        out = kernel.dense(x.contiguous(), self.panels, self.out_features)
        return out if self.bias is None else out.add_(self.bias)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}"


def panels_available(dtype: torch.dtype, device: torch.device, exact: bool) -> bool:
    """Whether linear layers of `dtype` take PanelLinear: the CPU, not the exact mode, and a
    kernel built with bfloat16's dot products (AVX-512 BF16) or float32's (AVX-512, AVX2)."""
    if dtype not in (torch.bfloat16, torch.float32) or device.type != "cpu":
        return False
    if exact or exact_from_env():
        return False
    quant_matmul.enable()  # once per process; cached on disk
    kernel = quant_matmul.kernel()
    if kernel is None:
        return False
    return kernel.dense_bf16 if dtype == torch.bfloat16 else kernel.dense_f32


def use_panels(model: nn.Module, dtype: torch.dtype) -> int:
    """Swap every plain nn.Linear of `dtype` (and a tied lm_head, packed from the embeddings)
    for a PanelLinear; the number swapped. The caller checks `panels_available` first."""
    return swap_float_linears(model, dtype, PanelLinear)
