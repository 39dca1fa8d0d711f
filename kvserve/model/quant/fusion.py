"""One matmul for the projections that read the same input: q/k/v, and gate/up.

A checkpoint names each projection (q_proj, k_proj, ...) and the loader fills
them by those names; `fuse_projections` then replaces each set that a module
lists in its FUSED_PROJECTIONS with one layer whose weight is theirs, rows
stacked: one matmul, one dispatch and one pair of casts instead of three (a
decode step of a small model is mostly dispatch). Every layer kind keeps its
rows independent (a float weight, int8's per-row scales, int4's groups along
the input), so the stacked layer holds exactly the parts' weights; it runs
before quantization, which then packs the stacked weight. Where the parts
cannot be stacked (int4 rows that do not fill the packing's blocks, a GGUF
file mixing types), `LinearParts` runs them one by one: the same output, no
gain.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.model.quant.quant_linear import Int4Linear, Int8Linear, stacked_bias


class LinearParts(nn.Module):
    """Layers that could not be stacked, run one by one, outputs side by side."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def stack_linears(parts: list[nn.Module]) -> nn.Module:
    """One layer computing every part on the same input, their outputs side by side."""
    kinds = {type(p) for p in parts}
    stacked: nn.Module | None = None
    if kinds == {nn.Linear}:
        stacked = _stacked_linear([p for p in parts if isinstance(p, nn.Linear)])
    elif kinds == {Int8Linear}:
        stacked = Int8Linear.stacked([p for p in parts if isinstance(p, Int8Linear)])
    elif kinds == {Int4Linear}:
        stacked = Int4Linear.stacked([p for p in parts if isinstance(p, Int4Linear)])
    return LinearParts(parts) if stacked is None else stacked


def _stacked_linear(parts: list[nn.Linear]) -> nn.Linear | None:
    weights = [p.weight for p in parts]
    if len({(w.shape[1], w.dtype, w.device) for w in weights}) != 1:
        return None
    if len({p.bias is None for p in parts}) != 1:
        return None
    weight = torch.cat([w.detach() for w in weights])
    linear = nn.Linear(
        weight.shape[1], weight.shape[0], bias=parts[0].bias is not None, device="meta"
    )
    linear.weight = nn.Parameter(weight, requires_grad=False)
    bias = stacked_bias(parts)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)
    return linear


def fuse_projections(model: nn.Module) -> None:
    """Replace, in every module that lists them, the named projections by one stacked layer
    (`FUSED_PROJECTIONS`: {fused name: (part names, in output order)})."""
    for module in list(model.modules()):
        for fused, names in getattr(module, "FUSED_PROJECTIONS", {}).items():
            parts = [getattr(module, name) for name in names]
            for name in names:
                delattr(module, name)
            setattr(module, fused, stack_linears(parts))
