"""The per-layer building blocks against transformers' own, bit for bit: fewer torch calls
than the reference (kvserve.model.layers.common), never other numbers."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.llama import modeling_llama

from kvserve.model.checkpoint.config import RopeConfig
from kvserve.model.layers.common import RMSNorm, RotaryEmbedding, apply_partial_rotary, apply_rotary

HEAD_DIM = 64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rotary_equals_transformers(dtype):
    """Signed-sin tables and one call for q and k side by side: the reference's numbers."""
    config = transformers.LlamaConfig(
        hidden_size=4 * HEAD_DIM, num_attention_heads=4, rope_theta=50_000.0
    )
    reference = modeling_llama.LlamaRotaryEmbedding(config)
    positions = torch.tensor([0, 1, 7, 300, 4095])
    torch.manual_seed(0)
    q = torch.randn(1, 4, len(positions), HEAD_DIM, dtype=dtype) * 3
    k = torch.randn(1, 2, len(positions), HEAD_DIM, dtype=dtype) * 3
    cos, sin = reference(q, positions[None])
    want_q, want_k = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    ours = RotaryEmbedding(RopeConfig(theta=50_000.0), HEAD_DIM, torch.device("cpu"))
    tables = ours.cos_sin(positions, dtype)
    qk = torch.cat((q[0], k[0])).transpose(0, 1)  # [T, heads + kv_heads, head_dim]
    rotated = apply_rotary(qk, *tables).transpose(0, 1)
    assert torch.equal(rotated[:4], want_q[0])
    assert torch.equal(rotated[4:], want_k[0])
    # A strided view (q and k inside a fused qkv row) rotates the same way.
    qkv = torch.cat((qk, torch.zeros_like(qk[:, :2])), dim=1)
    assert torch.equal(apply_rotary(qkv[:, :6], *tables), rotated.transpose(0, 1))


def test_partial_rotary_leaves_the_tail_alone():
    ours = RotaryEmbedding(RopeConfig(theta=10_000.0), HEAD_DIM // 2, torch.device("cpu"))
    tables = ours.cos_sin(torch.arange(3), torch.float32)
    x = torch.randn(3, 2, HEAD_DIM)
    out = apply_partial_rotary(x, *tables)
    assert torch.equal(out[..., HEAD_DIM // 2 :], x[..., HEAD_DIM // 2 :])
    assert torch.equal(out[..., : HEAD_DIM // 2], apply_rotary(x[..., : HEAD_DIM // 2], *tables))
    assert not torch.equal(out[1:], x[1:])  # position 0 is the identity, the others are not


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_equals_transformers(dtype):
    reference = modeling_llama.LlamaRMSNorm(96, eps=1e-5).to(dtype)
    ours = RMSNorm(96, 1e-5).to(dtype)
    with torch.no_grad():
        reference.weight.normal_()
        ours.weight.copy_(reference.weight)
    x = (torch.randn(7, 96) * 4).to(dtype)
    with torch.inference_mode():
        assert torch.equal(ours(x), reference(x))
