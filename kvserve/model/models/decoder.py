"""The pre-norm decoder that Llama, Qwen2 and Qwen3 share.

The architectures differ only in a few switches (biases, per-head q/k norm),
collected in DecoderOptions; parameter names follow the Hugging Face
checkpoints so weights load by name without a mapping table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
from torch import nn

from kvserve.model.attention.attention_metadata import AttentionMetadata
from kvserve.model.attention.plain import paged_attention
from kvserve.model.checkpoint.config import ModelConfig
from kvserve.model.layers.common import GatedMLP, RMSNorm, RotaryEmbedding, apply_rotary, embedding


class LayersCall(Protocol):
    """Every layer of a step at once, where it can (kvserve.model.fused_decode)."""

    def run(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, ...],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        metas: Sequence[AttentionMetadata],
    ) -> bool:
        """Run the layers on x in place and say True, or do nothing and say False."""
        ...


@dataclass(frozen=True, slots=True)
class DecoderOptions:
    """The switches that tell the architectures apart."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    """Qwen3: RMSNorm over each head of q and k, before the rotary embedding."""


class DecoderAttention(nn.Module):
    """q/k/v load by their checkpoint names and run as one qkv_proj once the loader has
    fused them (kvserve.model.quant.fusion); q and k rotate together."""

    FUSED_PROJECTIONS: ClassVar[dict[str, tuple[str, ...]]] = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj")
    }
    qkv_proj: nn.Module  # set by the fusion

    def __init__(self, config: ModelConfig, options: DecoderOptions) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = d = config.head_dim
        self.scale = d**-0.5
        self.softcap: float | None = None
        """Attention logit soft-capping (Gemma 2): softcap * tanh(score / softcap)."""
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * d, bias=options.qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=options.qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=options.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * d, hidden, bias=options.o_bias)
        self.q_norm: nn.Module | None = RMSNorm(d, config.rms_norm_eps) if options.qk_norm else None
        self.k_norm: nn.Module | None = RMSNorm(d, config.rms_norm_eps) if options.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(x.shape[0], heads + 2 * kv_heads, self.head_dim)
        v = qkv[:, heads + kv_heads :]
        cos, sin = cos_sin
        if self.q_norm is None or self.k_norm is None:  # q and k side by side: one rotation
            qk = self.rotate(qkv[:, : heads + kv_heads], cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
        else:
            q = self.rotate(self.q_norm(qkv[:, :heads]), cos, sin)
            k = self.rotate(self.k_norm(qkv[:, heads : heads + kv_heads]), cos, sin)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.softcap)
        return self.o_proj(out)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The rotary embedding of [T, heads, head_dim] (a partial rotary model overrides
        this)."""
        return apply_rotary(x, cos, sin)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, options: DecoderOptions) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(config, options)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, options.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The residual stream `x` is updated in place: the model's forward owns it."""
        attended = self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta)
        return x.add_(self.feed_forward(self.post_attention_layernorm.add_and_norm(x, attended)))

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        """The MLP (a mixture-of-experts layer runs its sparse block instead)."""
        return self.mlp(h)


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, layer: Callable[[int], nn.Module]) -> None:
        """`layer(index)` builds each decoder layer (`DecoderForCausalLM.decoder_layer`)."""
        super().__init__()
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layer(i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DecoderForCausalLM(nn.Module):
    """Token ids of a whole (flattened) batch in, final hidden states out.

    Subclasses only pick their DecoderOptions. The module may be built on the
    meta device (the loader does); the rotary tables are created on the real
    device by `init_rotary` once the weights are in place.
    """

    CUDA_GRAPHS: ClassVar[bool] = True
    """Whether a decode step's forward can be captured in a CUDA graph (no host sync, no
    data-dependent Python): the runner replays decode steps from graphs only then."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        options = self.options(config)
        self.model = DecoderModel(config, lambda i: self.decoder_layer(config, options, i))
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.rotary: RotaryEmbedding | None = None
        self.fused_decode: LayersCall | None = None
        """The layers of a decode step as one C call (kvserve.model.fused_decode): planned by
        the CPU runner where the layers allow it."""

    @staticmethod
    def options(config: ModelConfig) -> DecoderOptions:
        raise NotImplementedError

    def decoder_layer(self, config: ModelConfig, options: DecoderOptions, index: int) -> nn.Module:
        """Layer `index` (a mixture-of-experts model puts its sparse blocks in some)."""
        return DecoderLayer(config, options)

    def init_rotary(self, device: torch.device) -> None:
        self.rotary = RotaryEmbedding(self.config.rope, self.config.rotary_dim, device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        metas: Sequence[AttentionMetadata],
    ) -> torch.Tensor:
        """`kv_caches` and `metas` per layer (a layer reads its KV cache group's metadata)."""
        x = self.model.embed_tokens(input_ids)
        assert self.rotary is not None  # init_rotary (the loader calls it)
        cos_sin = self.rotary.cos_sin(positions, x.dtype)
        fused = self.fused_decode
        if fused is not None and fused.run(x, cos_sin, kv_caches, metas):
            return self.model.norm(x)
        for layer, kv_cache, meta in zip(self.model.layers, kv_caches, metas, strict=True):
            x = layer(x, cos_sin, kv_cache, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in float32 (the sampler's precision) for the selected hidden states."""
        return self.project_logits(hidden).float()

    def project_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states times the lm_head, or the embeddings when tied (a quantized model
        may hold a packed lm_head even then: kvserve.model.quant.quantize)."""
        if self.lm_head is None:
            return nn.functional.linear(hidden, self.model.embed_tokens.weight)
        return self.lm_head(hidden)
