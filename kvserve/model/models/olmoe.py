"""OLMoE: experts in every layer, and an attention of its own.

What differs from the shared attention: q and k are normalised over the whole
projection (one RMSNorm over all heads of q, one over all heads of k), not per
head, and `clip_qkv`, when the config sets it, clamps q, k and v after the
norms, as transformers' OlmoeAttention does.
"""

from __future__ import annotations

import torch

from kvserve.model.attention.attention_metadata import AttentionMetadata
from kvserve.model.attention.plain import paged_attention
from kvserve.model.checkpoint.config import ModelConfig
from kvserve.model.layers.common import RMSNorm
from kvserve.model.models.decoder import DecoderAttention, DecoderOptions
from kvserve.model.models.moe_decoder import MoeForCausalLM


class OlmoeAttention(DecoderAttention):
    def __init__(self, config: ModelConfig, options: DecoderOptions) -> None:
        super().__init__(config, options)
        eps = config.rms_norm_eps
        self.q_norm = RMSNorm(self.num_heads * self.head_dim, eps)
        self.k_norm = RMSNorm(self.num_kv_heads * self.head_dim, eps)
        clip = config.raw.get("clip_qkv")
        self.clip = None if clip is None else float(clip)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        assert self.q_norm is not None and self.k_norm is not None  # set above
        tokens, d = x.shape[0], self.head_dim
        q_width, kv_width = self.num_heads * d, self.num_kv_heads * d
        q, k, v = self.qkv_proj(x).split((q_width, kv_width, kv_width), dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        cos, sin = cos_sin
        q = self.rotate(q.reshape(tokens, self.num_heads, d), cos, sin)
        k = self.rotate(k.reshape(tokens, self.num_kv_heads, d), cos, sin)
        v = v.reshape(tokens, self.num_kv_heads, d)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(out)


class OlmoeForCausalLM(MoeForCausalLM):
    @staticmethod
    def options(config: ModelConfig) -> DecoderOptions:
        return DecoderOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias)

    def attention(self, config: ModelConfig, options: DecoderOptions) -> OlmoeAttention:
        return OlmoeAttention(config, options)
