"""Tiny Mistral, Phi-3 and Gemma 2 checkpoints (built like the others in tests/conftest.py).

Each config sets what the family's reader must get right, away from its default:

- mistral: a sliding window of 5 tokens on every layer, over blocks of 4 (the
  engine tests' prompts are longer: blocks really leave the window);
- phi3: half of each head rotated (partial_rotary_factor 0.5) with longrope
  scaling (its short factors and attention factor; the long ones apply past the
  original context of 64 tokens, where transformers recomputes the whole
  sequence: kvserve.model.checkpoint.longrope; tests/model/layers/test_longrope.py
  checks those tables);
- gemma2: sliding and global layers alternating (window 7), a query scale and
  both soft-caps small enough to bite (random norm weights, as for Gemma 3).
"""

from __future__ import annotations

import torch
import transformers

DENSE_ARCHS = {
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(sliding_window=5, rope_theta=50_000.0, tie_word_embeddings=False),
        {},
    ),
    "phi3": (
        transformers.Phi3Config,
        transformers.Phi3ForCausalLM,
        dict(
            partial_rotary_factor=0.5,
            max_position_embeddings=256,
            original_max_position_embeddings=64,
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0, 1.3, 1.9, 2.5],
                "long_factor": [1.5, 3.0, 6.0, 11.0],
            },
            tie_word_embeddings=False,
        ),
        {},
    ),
    "gemma2": (
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        dict(
            num_hidden_layers=4,
            head_dim=16,
            sliding_window=7,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=0.5,
            final_logit_softcapping=3.0,
            tie_word_embeddings=False,
            attn_implementation="eager",
            initializer_range=0.02,
        ),
        {},
    ),
}
"""arch -> (config class, model class, config overrides, save_pretrained kwargs)."""


def liven(arch: str, model: transformers.PreTrainedModel) -> None:
    """Gemma 2: random norms (they start at zero, scale 1 + w: random ones test the
    (1 + w) scaling) and large q/k weights, so that attention scores reach the soft-cap."""
    if arch != "gemma2":
        return
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.5)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(20.0)
