"""Gemma 2: Gemma 3's layer (four norms, (1 + weight) RMSNorm, gelu-tanh MLP, scaled
embeddings) with attention logit soft-capping, no q/k norms and one rope for all layers.

Layers alternate sliding-window and global attention (`layer_types`; older configs:
sliding first, every other layer), read by kvserve.model.checkpoint.layer_windows.
The attention scores are soft-capped (`attn_logit_softcapping`) before the mask and
softmax, the final logits too (`final_logit_softcapping`); every attention backend
applies the cap (kvserve.model.attention). Defaults are Gemma2Config's, for config
files that omit a key.
"""

from __future__ import annotations

import torch

from kvserve.model.checkpoint.config import ModelConfig
from kvserve.model.layers.common import RotaryEmbedding
from kvserve.model.models.gemma3 import Gemma3Attention, Gemma3ForCausalLM

DEFAULTS = {
    "query_pre_attn_scalar": 256,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
}
"""Gemma2Config's values for the keys a config.json may leave out."""


def setting(config: ModelConfig, key: str) -> float | None:
    value = config.raw.get(key, DEFAULTS[key])
    return None if value is None else float(value)


class Gemma2Attention(Gemma3Attention):
    """Gemma 3's attention without q/k norms, with soft-capped scores."""

    def __init__(self, config: ModelConfig, window: int | None) -> None:
        super().__init__(config, window)
        self.q_norm = None
        self.k_norm = None
        self.scale = float(setting(config, "query_pre_attn_scalar") or self.head_dim) ** -0.5
        self.softcap = setting(config, "attn_logit_softcapping")


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Token ids of a flattened batch in, final hidden states out (see DecoderForCausalLM)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        windows = config.layer_windows or [None] * config.num_layers
        for layer, window in zip(self.model.layers, windows, strict=True):
            layer.self_attn = Gemma2Attention(config, window)
        self.final_softcap = setting(config, "final_logit_softcapping")

    def init_rotary(self, device: torch.device) -> None:
        """One rope (rope_theta and its scaling) for sliding and global layers alike."""
        self.rotary = RotaryEmbedding(self.config.rope, self.config.head_dim, device)
        self.local_rotary = self.rotary
