"""Linear layers with their weights pre-packed for oneDNN, on the CPU, where kvserve's own
kernels do not take them (kvserve.model.quant.panel_linear): bfloat16 in the exact mode or
on a CPU without AVX-512 BF16, float32 outside the exact mode on a CPU with neither AVX2
nor AVX-512.

torch's `F.linear` on the CPU hands the weight in its plain row-major layout to
the matmul library, which copies it into its blocked layout on every call
(oneDNN for bfloat16; MKL's sgemm for float32, whose per-call packing makes a
16-row matmul of the default model's layers take 1.5-3x a one-row one).
`torch.ops.mkldnn` (what inductor's CPU backend emits for a frozen linear) lets
the reorder happen once: `_reorder_linear_weight` packs the weight,
`_linear_pointwise` runs oneDNN's matmul on the packed copy.

- bfloat16: the results are F.linear's bits (the tests check it, and the loader
  packs only when a probe matmul agrees); one decode step's matmuls take
  0.5-0.8x the CPU time (benchmarks/README.md, "profile_step").
- float32: oneDNN's kernels sum in another order than MKL's, so the results
  differ from transformers' in the last bits (about 1e-6 relative): greedy tokens
  stay the same on the default model's benchmark prompts, but a near tie can
  flip. This is vLLM's float32 path too. The engine's exact mode (`exact`,
  `--exact`, or KVSERVE_EXACT=1) keeps F.linear: token for token what
  transformers computes, which the oracle tests use.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.engine.engine_args import exact_from_env
from kvserve.model.quant.quantize import swap_float_linears

LINEAR = torch.ops.mkldnn._linear_pointwise.default
"""The packed matmul's overload, resolved once."""

PACKED = (torch.bfloat16, torch.float32)


class OneDNNLinear(nn.Module):
    """y = x W^T + b with W packed for oneDNN (bfloat16 or float32, on the CPU only)."""

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


def onednn_available(dtype: torch.dtype, device: torch.device, exact: bool = False) -> bool:
    """Whether weights of `dtype` are packed here: the CPU and oneDNN (with bfloat16 for
    bfloat16), and a probe matmul that gives F.linear's bits for bfloat16, or its values
    within float32's rounding for float32 (never in the exact mode)."""
    if dtype not in PACKED or device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32 and (exact or exact_from_env()):
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 64, generator=gen).to(dtype)
    x = torch.randn(5, 64, generator=gen).to(dtype)
    try:
        packed = OneDNNLinear(weight, None)(x)
    except RuntimeError:  # a build without the packed ops
        return False
    plain = nn.functional.linear(x, weight)
    if dtype == torch.bfloat16:
        return torch.equal(packed, plain)
    return torch.allclose(packed, plain, rtol=1e-5, atol=1e-5)


def pack_linears(model: nn.Module, dtype: torch.dtype) -> int:
    """Swap every plain nn.Linear of `dtype` (and a tied lm_head, as a packed copy of the
    embeddings) for a OneDNNLinear; the number of layers packed. The caller checks
    `onednn_available` first."""
    return swap_float_linears(model, dtype, OneDNNLinear)
