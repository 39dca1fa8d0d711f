"""A checkpoint's state dict as the loader leaves the model: the projections that
kvserve.model.quant.fusion stacks into one layer, stacked (q/k/v -> qkv_proj, gate/up ->
gate_up_proj), so tests compare a loaded model with its checkpoint name by name."""

from __future__ import annotations

import torch

from kvserve.model.layers.common import GatedMLP
from kvserve.model.models.decoder import DecoderAttention

STACKED = {**DecoderAttention.FUSED_PROJECTIONS, **GatedMLP.FUSED_PROJECTIONS}


def stacked_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with each set of stacked parts replaced by their rows, concatenated."""
    out = dict(state)
    for key in state:
        for fused, parts in STACKED.items():
            module, found, tensor = key.rpartition(f".{parts[0]}.")
            if found:
                names = [f"{module}.{part}.{tensor}" for part in parts]
                out[f"{module}.{fused}.{tensor}"] = torch.cat([out.pop(n) for n in names])
    return out
