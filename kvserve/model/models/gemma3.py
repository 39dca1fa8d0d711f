"""Gemma 3 (text): interleaved sliding-window and global attention layers.

What sets it apart from the Llama-style decoder: RMSNorm scales by
(1 + weight) and multiplies in float32 before casting back; four norms per
layer (around attention and around the MLP); q/k norms per head; a gelu-tanh
gated MLP; the embedding scaled by sqrt(hidden_size); the attention scale
query_pre_attn_scalar^-0.5; local (sliding) layers use their own rope base
(rope_local_base_freq) and global layers rope_theta with its scaling; and
optional soft-capping of the final logits (attn_logit_softcapping is read by
transformers' config but not applied by its Gemma3 attention, so not here
either; paged_attention supports it for models that do). Sliding layers
read only their window; the runner gives them sliding-window KV cache groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from kvserve.model.attention.attention_metadata import AttentionMetadata
from kvserve.model.checkpoint.config import ModelConfig, RopeConfig, _rope_config
from kvserve.model.layers.common import GatedMLP, RotaryEmbedding, embedding
from kvserve.model.models.decoder import DecoderAttention, DecoderForCausalLM, DecoderOptions

DEFAULT_GLOBAL_THETA = 1_000_000.0
DEFAULT_LOCAL_THETA = 10_000.0


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), all in float32, cast back at the end."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GemmaMLP(GatedMLP):
    """The gated MLP with gelu-tanh for silu, and no biases."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__(hidden, intermediate, bias=False)

    def activation(self, gate: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(gate, approximate="tanh")


def gemma3_ropes(raw: dict[str, Any]) -> tuple[RopeConfig, RopeConfig]:
    """(global, local) rope: `rope_parameters` per layer type (transformers 5), or
    rope_theta + rope_scaling (global) and rope_local_base_freq (local)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        full = {"rope_theta": DEFAULT_GLOBAL_THETA, **(params.get("full_attention") or {})}
        local = {"rope_theta": DEFAULT_LOCAL_THETA, **(params.get("sliding_attention") or {})}
        return _rope_config({"rope_parameters": full}), _rope_config({"rope_parameters": local})
    full_raw = {
        "rope_theta": raw.get("rope_theta", DEFAULT_GLOBAL_THETA),
        "rope_scaling": raw.get("rope_scaling"),
        "max_position_embeddings": raw.get("max_position_embeddings", 8192),
    }
    local_theta = float(raw.get("rope_local_base_freq", DEFAULT_LOCAL_THETA))
    return _rope_config(full_raw), RopeConfig(theta=local_theta)


class Gemma3Attention(DecoderAttention):
    """The shared attention with Gemma's norms, its query scale and a layer window.

    transformers' Gemma3 attention never applies attn_logit_softcapping (Gemma 3
    checkpoints set it to null; Gemma 2 used it): the reference ignores it, so do we.
    """

    def __init__(self, config: ModelConfig, window: int | None) -> None:
        bias = config.attention_bias
        super().__init__(config, DecoderOptions(qkv_bias=bias, o_bias=bias, qk_norm=True))
        self.window = window
        self.scale = float(config.raw.get("query_pre_attn_scalar") or self.head_dim) ** -0.5
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if meta.window != self.window:
            raise ValueError(f"layer window {self.window} got metadata for {meta.window}")
        return super().forward(x, cos_sin, kv_cache, meta)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, window: int | None) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.is_sliding = window is not None
        self.self_attn = Gemma3Attention(config, window)
        self.mlp = GemmaMLP(hidden, config.intermediate_size)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class Gemma3Model(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        windows = config.layer_windows or [None] * config.num_layers
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, w) for w in windows)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)


class Gemma3ForCausalLM(DecoderForCausalLM):
    """Token ids of a flattened batch in, final hidden states out (see DecoderForCausalLM)."""

    def __init__(self, config: ModelConfig) -> None:
        nn.Module.__init__(self)
        self.config = config
        # The base class declares a DecoderModel: Gemma's has its own layers and norms.
        self.model = Gemma3Model(config)  # type: ignore[assignment]  # Gemma's own layer stack
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.final_softcap = config.raw.get("final_logit_softcapping")
        self.rotary: RotaryEmbedding | None = None
        self.local_rotary: RotaryEmbedding | None = None

    def init_rotary(self, device: torch.device) -> None:
        full, local = gemma3_ropes(self.config.raw)
        self.rotary = RotaryEmbedding(full, self.config.head_dim, device)
        self.local_rotary = RotaryEmbedding(local, self.config.head_dim, device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        metas: Sequence[AttentionMetadata],
    ) -> torch.Tensor:
        embed = self.model.embed_tokens
        scale = torch.tensor(self.config.hidden_size**0.5).to(embed.weight.dtype)
        x = embed(input_ids) * scale
        assert self.rotary is not None and self.local_rotary is not None  # init_rotary
        global_cs = self.rotary.cos_sin(positions, x.dtype)
        local_cs = (
            global_cs  # one rope for both (Gemma 2)
            if self.local_rotary is self.rotary
            else self.local_rotary.cos_sin(positions, x.dtype)
        )
        for layer, kv_cache, meta in zip(self.model.layers, kv_caches, metas, strict=True):
            x = layer(x, local_cs if layer.is_sliding else global_cs, kv_cache, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.project_logits(hidden)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits.float()
