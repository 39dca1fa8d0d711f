"""Which layers slide, read as each family's transformers config reads it
(kvserve.model.checkpoint.layer_windows)."""

from __future__ import annotations

import pytest

from kvserve.model.checkpoint.config import ModelConfig
from kvserve.model.checkpoint.errors import ModelLoadError

BASE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    vocab_size=32,
)  # fmt: skip


def windows(arch: str, **fields) -> list[int | None]:
    if arch.startswith("Gemma"):
        fields.setdefault("hidden_activation", "gelu_pytorch_tanh")
    return ModelConfig.from_dict({"architectures": [arch], **BASE, **fields}).layer_windows


def test_mistral_and_phi3_slide_on_every_layer_or_none():
    assert windows("MistralForCausalLM") == [4096] * 4  # MistralConfig's default
    assert windows("MistralForCausalLM", sliding_window=None) == []
    assert windows("MistralForCausalLM", sliding_window=7) == [7] * 4
    assert windows("Phi3ForCausalLM") == []  # Phi3Config's default: null
    assert windows("Phi3ForCausalLM", sliding_window=2047) == [2047] * 4
    with pytest.raises(ModelLoadError, match="positive 'sliding_window', got 0"):
        windows("MistralForCausalLM", sliding_window=0)


def test_gemma_layers_alternate_by_their_types_or_their_period():
    assert windows("Gemma2ForCausalLM", sliding_window=5) == [5, None, 5, None]
    types = ["full_attention", "sliding_attention", "full_attention", "full_attention"]
    assert windows("Gemma2ForCausalLM", sliding_window=5, layer_types=types) == [
        None, 5, None, None
    ]  # fmt: skip
    assert windows("Gemma3ForCausalLM", sliding_window=5, num_hidden_layers=6) == [5] * 5 + [None]
    assert windows("Gemma3ForCausalLM", layer_types=["full_attention"] * 4) == [None] * 4


def test_families_without_windows_refuse_one():
    assert windows("Qwen2ForCausalLM", sliding_window=7) == []  # use_sliding_window unset
    with pytest.raises(ModelLoadError, match="not supported for this architecture"):
        windows("Qwen2ForCausalLM", sliding_window=7, use_sliding_window=True)
