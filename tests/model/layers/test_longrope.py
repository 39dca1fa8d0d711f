"""Phi-3's longrope tables against transformers' own: short factors inside the original
context, long ones past it, both times the attention factor, over a partial rotary dim.

transformers picks one set per forward (kvserve.model.checkpoint.longrope says why kvserve
picks per token): a forward over positions inside the original context gives the short
tables, one that reaches past it the long tables; kvserve must give, at every position,
the table its position selects.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.phi3 import modeling_phi3

from kvserve.model.checkpoint.config import ModelConfig
from kvserve.model.checkpoint.errors import ModelLoadError
from kvserve.model.layers.common import RotaryEmbedding

ORIGINAL = 32


def phi3_config(**rope) -> transformers.Phi3Config:
    return transformers.Phi3Config(
        architectures=["Phi3ForCausalLM"],
        hidden_size=128,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        vocab_size=32,
        partial_rotary_factor=0.75,  # head_dim 32: 24 rotated dims, 12 factors
        max_position_embeddings=8 * ORIGINAL,
        original_max_position_embeddings=ORIGINAL,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.1 * i for i in range(12)],
            "long_factor": [1.5 + 2.0 * i for i in range(12)],
            **rope,
        },
    )


@pytest.mark.parametrize("rope", [{}, {"attention_factor": 0.8}], ids=["derived", "given"])
def test_tables_equal_transformers_on_each_side_of_the_original_context(rope):
    config = phi3_config(**rope)
    reference = modeling_phi3.Phi3RotaryEmbedding(config)
    ours_config = ModelConfig.from_dict(config.to_dict())
    assert ours_config.rotary_dim == 24
    ours = RotaryEmbedding(ours_config.rope, ours_config.rotary_dim, torch.device("cpu"))
    inside = torch.arange(ORIGINAL)
    past = torch.arange(ORIGINAL, 3 * ORIGINAL)
    x = torch.zeros(1, 1, 32)
    short_cos, short_sin = reference(x, inside[None])
    long_cos, long_sin = reference(x, torch.arange(3 * ORIGINAL)[None])
    cos, signed_sin = ours.cos_sin(torch.cat((inside, past)), torch.float32)
    half = 12
    assert torch.equal(cos[:ORIGINAL, 0], short_cos[0])
    assert torch.equal(signed_sin[:ORIGINAL, 0, half:], short_sin[0, :, half:])
    assert torch.equal(cos[ORIGINAL:, 0], long_cos[0, ORIGINAL:])
    assert torch.equal(signed_sin[ORIGINAL:, 0, half:], long_sin[0, ORIGINAL:, half:])
    assert not torch.equal(short_cos[0], long_cos[0, :ORIGINAL])  # the two sets differ


def test_su_is_longrope_for_phi3_and_bad_factors_are_refused():
    raw = phi3_config().to_dict()
    raw["rope_parameters"]["rope_type"] = "su"
    assert ModelConfig.from_dict(raw).rope.scaling_type == "longrope"
    raw["rope_parameters"]["long_factor"] = [2.0] * 3
    with pytest.raises(ModelLoadError, match="needs 12 long_factor values"):
        ModelConfig.from_dict(raw)
    del raw["rope_parameters"]["short_factor"]
    with pytest.raises(ModelLoadError, match="needs a list 'short_factor'"):
        ModelConfig.from_dict(raw)
