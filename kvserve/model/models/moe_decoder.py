"""The decoder of the mixture-of-experts families: the shared decoder, sparse blocks inside.

Qwen3-MoE, OLMoE and Mixtral are the Llama-style pre-norm decoder with the
MLP of some (Qwen3-MoE: `mlp_only_layers`, `decoder_sparse_step`) or all
layers replaced by a SparseMoeBlock (kvserve.model.layers.moe). The block sits
where the family's checkpoint puts it (`mlp`, Mixtral's `block_sparse_moe`),
so weights load by their own names; a family only says where, and what its
experts and attention are.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from kvserve.model.checkpoint.config import ModelConfig
from kvserve.model.checkpoint.moe_config import MoeConfig, moe_config
from kvserve.model.layers.common import GatedMLP
from kvserve.model.layers.moe import SparseMoeBlock
from kvserve.model.models.decoder import (
    DecoderAttention,
    DecoderForCausalLM,
    DecoderLayer,
    DecoderOptions,
)


def gated_expert(hidden: int, intermediate: int) -> nn.Module:
    """Qwen3-MoE's and OLMoE's expert: a bias-free gated MLP (gate_proj, up_proj, down_proj)."""
    return GatedMLP(hidden, intermediate, bias=False)


class MoeDecoderLayer(DecoderLayer):
    """A decoder layer whose feed-forward is the module named `block_name` (the sparse block,
    or in Qwen3-MoE's `mlp_only_layers` a dense MLP)."""

    def __init__(
        self,
        config: ModelConfig,
        options: DecoderOptions,
        block: nn.Module,
        block_name: str,
    ) -> None:
        super().__init__(config, options)
        del self.mlp
        self.block_name = block_name
        setattr(self, block_name, block)

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        block: nn.Module = getattr(self, self.block_name)
        return block(h)


class MoeForCausalLM(DecoderForCausalLM):
    """A family sets BLOCK_NAME and EXPERT, and may replace the attention (`attention`)."""

    BLOCK_NAME: ClassVar[str] = "mlp"
    EXPERT: ClassVar = staticmethod(gated_expert)
    CUDA_GRAPHS = False  # the expert dispatch reads the step's routing on the host
    moe: MoeConfig

    def decoder_layer(self, config: ModelConfig, options: DecoderOptions, index: int) -> nn.Module:
        if not hasattr(self, "moe"):
            self.moe = moe_config(config)  # read once, before the first layer
        block: nn.Module
        if self.moe.sparse_layers[index]:
            block = SparseMoeBlock(config.hidden_size, self.moe, self.EXPERT)
        else:
            block = GatedMLP(config.hidden_size, config.intermediate_size, bias=False)
        layer = MoeDecoderLayer(config, options, block, self.BLOCK_NAME)
        attention = self.attention(config, options)
        if attention is not None:
            layer.self_attn = attention
        return layer

    def attention(self, config: ModelConfig, options: DecoderOptions) -> DecoderAttention | None:
        """The family's own attention module, or None for the shared one."""
        return None
