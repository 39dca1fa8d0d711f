"""bfloat16 linear layers on kvserve's AVX-512 BF16 kernel (kvserve.model.cpu_kernels.
quant_matmul's `dense`, dense_bf16.h), on a CPU that has those instructions, outside the
exact mode: every call, decode steps and prefills.

Why: a decode step of a bfloat16 model is a few rows through every layer, about a
quarter of it Python between the kernels (benchmarks/profile_step.py). The fused decode
(kvserve.model.fused_decode) removes that, but it runs C kernels only, and oneDNN's
matmul is not one it can call. The weight is kept in the kernel's "panels" (sixteen
output columns with their input pairs interleaved, `pack_panels`), the layout oneDNN's
own packing uses, so no call reorders it, and one layout serves every row count: a
row's bits never depend on the size of its batch or chunk.

Numerics: float32 sums of bfloat16 products, as oneDNN's, in another order, so the last
bits differ from F.linear's. The engine's exact mode keeps OneDNNLinear, F.linear's bits
(kvserve.model.quant.onednn_linear). A tied lm_head holds its own panels (the embeddings
stay rows, for the lookup), as OneDNNLinear holds a packed copy.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.engine.engine_args import exact_from_env
from kvserve.model.cpu_kernels import quant_matmul
from kvserve.model.quant.quantize import linear_modules, replace_module

PANEL = 16
"""Output columns a panel holds (one AVX-512 vector of float32 sums)."""


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / 16), ceil(K / 2), 16, 2]: panel p, pair j holds w[16p + i, 2j + c]
    at [p, j, i, c]; rows and columns past N and K are zeros."""
    n, k = weight.shape
    n_pad, k_pad = -n % PANEL, k % 2
    padded = nn.functional.pad(weight.detach(), (0, k_pad, 0, n_pad))
    shape = (padded.shape[0] // PANEL, PANEL, padded.shape[1] // 2, 2)
    return padded.reshape(shape).permute(0, 2, 1, 3).contiguous()


def unpack_panels(panels: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """pack_panels' inverse: the weight [N, K]."""
    count, pairs = panels.shape[:2]
    rows = panels.permute(0, 2, 1, 3).reshape(count * PANEL, pairs * 2)
    return rows[:out_features, :in_features].contiguous()


class DenseBf16Linear(nn.Module):
    """y = x W^T + b in bfloat16, W in the kernel's panels (`pack_panels`)."""

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
        if kernel is None or x.dtype != torch.bfloat16 or x.device.type != "cpu":
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return nn.functional.linear(x, self.weight.to(x.dtype), bias)
        out = kernel.dense(x.contiguous(), self.panels, self.out_features)
        return out if self.bias is None else out.add_(self.bias)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}"


def dense_bf16_available(dtype: torch.dtype, device: torch.device, exact: bool) -> bool:
    """Whether bfloat16 layers take DenseBf16Linear: the CPU, bfloat16, not the exact mode,
    and a kernel built with AVX-512 BF16."""
    if dtype != torch.bfloat16 or device.type != "cpu" or exact or exact_from_env():
        return False
    quant_matmul.enable()  # once per process; cached on disk
    kernel = quant_matmul.kernel()
    return kernel is not None and kernel.dense_bf16


def use_dense_bf16(model: nn.Module) -> int:
    """Swap every plain bfloat16 nn.Linear (and a tied lm_head, packed from the embeddings)
    for a DenseBf16Linear; the number swapped. The caller checks `dense_bf16_available`
    first."""
    count = 0
    for name, module in linear_modules(model).items():
        if type(module) is nn.Linear and module.weight.dtype == torch.bfloat16:
            replace_module(model, name, DenseBf16Linear(module.weight, module.bias))
            count += 1
    embeddings = model.get_parameter("model.embed_tokens.weight")
    if getattr(model, "lm_head", None) is None and embeddings.dtype == torch.bfloat16:
        replace_module(model, "lm_head", DenseBf16Linear(embeddings, None))
        count += 1
    return count
