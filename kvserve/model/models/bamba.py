"""Bamba: a hybrid of Mamba2 mixers and Llama-style attention layers.

Each layer is either a Mamba2 mixer (`mamba`) or, at `attn_layer_indices`,
grouped-query attention (`self_attn`); both are pre-normed and followed by a
SwiGLU MLP (`feed_forward`, after `pre_ff_layernorm`). What differs from the
Llama decoder: attention rotates only the first `partial_rotary_factor` (0.5)
of each head, and the mamba layers carry per-request state pages instead of a
KV cache (see kvserve/model/layers/mamba2.py). `config.layer_kinds` tells the runner
which layer needs which: attention layers get (k_cache, v_cache) and an
AttentionMetadata, mamba layers (conv_states, ssm_states) and a StateMetadata.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from kvserve.model.attention.attention_metadata import AttentionMetadata
from kvserve.model.checkpoint.config import ModelConfig
from kvserve.model.layers.common import (
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
    apply_partial_rotary,
    embedding,
)
from kvserve.model.layers.mamba2 import Mamba2Mixer, StateMetadata
from kvserve.model.models.decoder import DecoderAttention, DecoderForCausalLM, DecoderOptions

LayerMeta = AttentionMetadata | StateMetadata


class BambaAttention(DecoderAttention):
    """Llama attention (bias on all four projections or none) with partial rotary."""

    def __init__(self, config: ModelConfig) -> None:
        bias = config.attention_bias
        super().__init__(config, DecoderOptions(qkv_bias=bias, o_bias=bias))

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_partial_rotary(x, cos, sin)


class BambaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, kind: str) -> None:
        super().__init__()
        self.kind = kind
        if kind == "mamba":
            self.mamba = Mamba2Mixer(config)
        else:
            self.self_attn = BambaAttention(config)
        self.feed_forward = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
        cache: tuple[torch.Tensor, torch.Tensor],
        meta: LayerMeta,
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.kind == "mamba":
            if not isinstance(meta, StateMetadata):
                raise TypeError(f"a mamba layer needs StateMetadata, got {type(meta).__name__}")
            h = self.mamba(h, cache, meta)
        else:
            if isinstance(meta, StateMetadata):  # either attention backend's metadata goes
                raise TypeError("an attention layer needs attention metadata, got StateMetadata")
            h = self.self_attn(h, cos_sin, cache, meta)
        x = x + h
        return x + self.feed_forward(self.pre_ff_layernorm(x))


class BambaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(BambaDecoderLayer(config, k) for k in config.layer_kinds)
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class BambaForCausalLM(DecoderForCausalLM):
    """Token ids of a flattened batch in, final hidden states out (see DecoderForCausalLM)."""

    def __init__(self, config: ModelConfig) -> None:
        nn.Module.__init__(self)
        if config.mamba is None or len(config.layer_kinds) != config.num_layers:
            raise ValueError("BambaForCausalLM needs a config parsed with its layer kinds")
        self.config = config
        # The base class declares a DecoderModel: Bamba's has mamba layers and final_layernorm.
        self.model: BambaModel = BambaModel(config)  # type: ignore[assignment]  # Bamba's own stack
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.rotary: RotaryEmbedding | None = None

    def init_rotary(self, device: torch.device) -> None:
        self.rotary = RotaryEmbedding(self.config.rope, self.config.rotary_dim, device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        metas: Sequence[LayerMeta],
    ) -> torch.Tensor:
        """Per layer: (k_cache, v_cache) + AttentionMetadata, or (conv_states, ssm_states) +
        StateMetadata, as config.layer_kinds says."""
        x = self.model.embed_tokens(input_ids)
        cos_sin = None
        if "attention" in self.config.layer_kinds:
            assert self.rotary is not None  # init_rotary (the loader calls it)
            cos_sin = self.rotary.cos_sin(positions, x.dtype)
        for layer, cache, meta in zip(self.model.layers, kv_caches, metas, strict=True):
            x = layer(x, cos_sin, cache, meta)
        return self.model.final_layernorm(x)
