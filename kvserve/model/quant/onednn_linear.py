"""bfloat16 linear layers with their weights pre-packed for oneDNN, on the CPU.

torch's bfloat16 `F.linear` on the CPU already runs oneDNN's matmul, but
hands it the weight in its plain row-major layout, so oneDNN reorders the
weight into its blocked layout on every call. `torch.ops.mkldnn` (what
inductor's CPU backend emits for a frozen linear) lets the reorder happen
once: `_reorder_linear_weight` packs the weight, `_linear_pointwise` runs the
same oneDNN matmul on the packed copy. The results are the same bits as
`F.linear`'s (the tests check it, and the loader packs only when a probe
matmul agrees), and one decode step's matmuls take 0.5-0.8x the CPU time
(SmolLM2-135M at batch 1-16; 0.9-0.95x for a 1,000-token prefill:
benchmarks/README.md, "profile_step"). float32 is left alone: oneDNN's and
MKL's float32 kernels round differently from the matmul transformers runs,
and float32 is the engine's exact mode.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.model.quant.quantize import linear_modules, replace_module

LINEAR = torch.ops.mkldnn._linear_pointwise.default
"""The packed matmul's overload, resolved once."""


class OneDNNLinear(nn.Module):
    """y = x W^T + b with W packed for oneDNN (bfloat16 on the CPU only)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        """An opaque oneDNN tensor: not a parameter, never saved or moved."""
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self.forward(x.reshape(-1, self.in_features)).view(*x.shape[:-1], -1)
        return LINEAR(x.contiguous(), self.packed, self.bias, "none", [], "")


def onednn_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether bfloat16 weights can be packed here: the CPU, oneDNN with bfloat16, and a
    probe matmul that gives F.linear's bits."""
    if dtype != torch.bfloat16 or device.type != "cpu":
        return False
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return False
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 64, generator=gen).to(dtype)
    x = torch.randn(5, 64, generator=gen).to(dtype)
    try:
        packed = OneDNNLinear(weight, None)(x)
    except RuntimeError:  # a build without the packed ops
        return False
    return torch.equal(packed, nn.functional.linear(x, weight))


def pack_bfloat16_linears(model: nn.Module) -> int:
    """Swap every plain bfloat16 nn.Linear (and a tied lm_head, as a packed copy of the
    embeddings) for a OneDNNLinear; the number of layers packed. The caller checks
    `onednn_available` first."""
    count = 0
    for name, module in linear_modules(model).items():
        if type(module) is nn.Linear and module.weight.dtype == torch.bfloat16:
            replace_module(model, name, OneDNNLinear(module.weight, module.bias))
            count += 1
    embeddings = model.get_parameter("model.embed_tokens.weight")
    if getattr(model, "lm_head", None) is None and embeddings.dtype == torch.bfloat16:
        replace_module(model, "lm_head", OneDNNLinear(embeddings, None))
        count += 1
    return count
