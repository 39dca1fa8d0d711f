"""bfloat16 linear layers whose few-row calls (decode steps) run kvserve's AVX-512 BF16
kernel (kvserve.model.cpu_kernels.quant_matmul's `dense`, dense_bf16.h), on a CPU that
has those instructions, outside the exact mode.

Why: a decode step of a bfloat16 model is a few rows through every layer, about a
quarter of it Python between the kernels (benchmarks/profile_step.py). The fused decode
(kvserve.model.fused_decode) removes that, but it runs C kernels only, and oneDNN's
matmul is not one it can call. With the layer's weight kept as it is ([N, K] bfloat16,
no packed copy), calls of fewer than DENSE_BF16_ROWS rows (decode steps, batches, short
prefill chunks) run this kernel, in the modules and in the fused call alike (the same
bits either way), and more rows run F.linear (oneDNN, which reorders the weight per
call: about 8% of a 256-row call).

Numerics: float32 sums of bfloat16 products, as oneDNN's, in another order, so the last
bits of a few-row call differ from F.linear's. The engine's exact mode keeps
OneDNNLinear, F.linear's bits (kvserve.model.quant.onednn_linear). A tied lm_head reads
the embeddings themselves (OneDNNLinear holds a packed copy).
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.engine.engine_args import exact_from_env
from kvserve.model.cpu_kernels import quant_matmul
from kvserve.model.quant.quantize import linear_modules, replace_module

DENSE_BF16_ROWS = 96
"""Calls of fewer rows run the kernel. The default model's 120 layer matmuls (2 threads, an
AMD EPYC with AVX-512 BF16): 0.77x oneDNN's packed time at 1 row, 1.06-1.3x at 4-64 rows,
where F.linear (which reorders the weight each call) takes 1.1-2.2x; at 96 rows the two
are even (75 and 76 ms), at 256 F.linear is faster (151 against 191 ms). A fused decode
step saves the Python between the layers besides."""


class DenseBf16Linear(nn.Module):
    """y = x W^T + b in bfloat16, W as it is: the kernel below DENSE_BF16_ROWS rows."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight.detach().contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self.forward(x.reshape(-1, self.in_features)).view(*x.shape[:-1], -1)
        kernel = quant_matmul.kernel()
        few = 0 < x.shape[0] < DENSE_BF16_ROWS and x.dtype == torch.bfloat16
        if kernel is None or not few or x.device.type != "cpu":
            return nn.functional.linear(x, self.weight, self.bias)
        out = kernel.dense(x.contiguous(), self.weight)
        return out if self.bias is None else out.add_(self.bias)


def dense_bf16_available(dtype: torch.dtype, device: torch.device, exact: bool) -> bool:
    """Whether bfloat16 layers take DenseBf16Linear: the CPU, bfloat16, not the exact mode,
    and a kernel built with AVX-512 BF16."""
    if dtype != torch.bfloat16 or device.type != "cpu" or exact or exact_from_env():
        return False
    quant_matmul.enable()  # once per process; cached on disk
    kernel = quant_matmul.kernel()
    return kernel is not None and kernel.dense_bf16


def use_dense_bf16(model: nn.Module) -> int:
    """Swap every plain bfloat16 nn.Linear (and a tied lm_head, over the embeddings
    themselves) for a DenseBf16Linear; the number swapped. The caller checks
    `dense_bf16_available` first."""
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
