"""Which K/V page each layer uses: per-layer specs, and the per-layer views into the
shared (K, V) tensors (a Mamba layer's state pages live in a K/V pair)."""

from __future__ import annotations

import math

import torch

from kvserve.kvcache.specs import (
    FullAttentionSpec,
    KVCacheSpec,
    MambaStateSpec,
    SlidingWindowSpec,
)
from kvserve.model.checkpoint.config import ModelConfig
from kvserve.model.memory.layer_groups import GroupLayout


def layer_kv_specs(config: ModelConfig, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
    """One spec per layer: full attention, a sliding window where the config has one,
    or a Mamba state.

    A state page lives in a K/V page pair: conv state in the K half, SSM state
    in the V half, so it needs twice the larger of the two.
    """
    element = torch.empty((), dtype=dtype).element_size()
    shape = dict(
        block_size=block_size,
        num_kv_heads=config.num_kv_heads,
        head_size=config.head_dim,
        dtype_bytes=element,
    )
    windows = config.layer_windows or [None] * config.num_layers
    kinds = config.layer_kinds or ["attention"] * config.num_layers
    state_bytes = 0
    if "mamba" in kinds:
        from kvserve.model.layers.mamba2 import state_shapes

        conv, ssm = state_shapes(config)
        state_bytes = 2 * max(math.prod(conv), math.prod(ssm)) * element
    return [
        MambaStateSpec(block_size=block_size, state_bytes=state_bytes)
        if kind == "mamba"
        else FullAttentionSpec(**shape)
        if w is None
        else SlidingWindowSpec(sliding_window=w, **shape)
        for kind, w in zip(kinds, windows, strict=True)
    ]


def state_views(
    k: torch.Tensor, v: torch.Tensor, config: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """A Mamba layer's (conv, ssm) state pages inside a K/V pair: one page per block id."""
    from kvserve.model.layers.mamba2 import state_shapes

    conv, ssm = state_shapes(config)
    blocks = k.shape[0]
    conv_view = k.view(blocks, -1)[:, : math.prod(conv)].view(blocks, *conv)
    ssm_view = v.view(blocks, -1)[:, : math.prod(ssm)].view(blocks, *ssm)
    return conv_view, ssm_view


def layer_caches(
    config: ModelConfig, layout: GroupLayout, kv_tensors: list[tuple[torch.Tensor, torch.Tensor]]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V), or (conv, ssm) state pages of a Mamba layer; layers in the
    same slot of different groups share tensors."""
    kinds = config.layer_kinds or ["attention"] * config.num_layers
    return [
        state_views(*kv_tensors[slot], config) if kind == "mamba" else kv_tensors[slot]
        for slot, kind in zip(layout.layer_slot, kinds, strict=True)
    ]
