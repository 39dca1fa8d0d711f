"""Phi-3 and Phi-4 (`Phi3ForCausalLM`): Llama's layout with q/k/v and gate/up stored fused.

The checkpoint holds `qkv_proj` (q rows, then k, then v) and `gate_up_proj`
(gate rows, then up), exactly the stacked layers kvserve.model.quant.fusion
builds for the other families, so they load as they are and nothing is fused
after loading. Attention may rotate only part of each head
(`partial_rotary_factor`, Phi-4-mini: 0.75), with plain or longrope scaling
(kvserve.model.checkpoint.longrope); an optional `sliding_window` applies to every
layer (kvserve.model.checkpoint.layer_windows). No biases.
"""

from typing import ClassVar

import torch
from torch import nn

from kvserve.model.checkpoint.config import ModelConfig
from kvserve.model.layers.common import GatedMLP, apply_partial_rotary
from kvserve.model.models.decoder import DecoderAttention, DecoderForCausalLM, DecoderOptions


class Phi3Attention(DecoderAttention):
    FUSED_PROJECTIONS: ClassVar[dict[str, tuple[str, ...]]] = {}  # stored fused

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, DecoderOptions())
        del self.q_proj, self.k_proj, self.v_proj
        rows = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, rows, bias=False)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_partial_rotary(x, cos, sin)


class Phi3MLP(GatedMLP):
    FUSED_PROJECTIONS: ClassVar[dict[str, tuple[str, ...]]] = {}  # stored fused

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__(hidden, intermediate, bias=False)
        del self.gate_proj, self.up_proj
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)


class Phi3ForCausalLM(DecoderForCausalLM):
    """The shared decoder with Phi-3's fused attention and MLP in every layer."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        for layer in self.model.layers:
            layer.self_attn = Phi3Attention(config)
            layer.mlp = Phi3MLP(config.hidden_size, config.intermediate_size)

    @staticmethod
    def options(config: ModelConfig) -> DecoderOptions:
        return DecoderOptions()
