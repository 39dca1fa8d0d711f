"""Building blocks shared by every decoder: RMSNorm, rotary embedding, gated MLP.

The arithmetic follows the reference (transformers) operation for operation,
in the same dtypes, so greedy decoding matches it token for token. What runs
once per layer is kept to few torch calls (a decode step of a small model is
mostly their dispatch): the rotary tables are built once per step, q and k
rotate together, and the MLP's gate and up projections are one matmul once the
loader has fused them (kvserve.model.quant.fusion). In bfloat16 on the CPU the norm
(with the residual add before it), the rotation and SiLU-and-multiply are one C call
each (kvserve.model.cpu_kernels.layer_ops: the same roundings in the same places).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import nn

from kvserve.model.checkpoint.config import RopeConfig
from kvserve.model.cpu_kernels.layer_ops import ops as layer_ops


def embedding(vocab_size: int, hidden_size: int) -> nn.Embedding:
    """An nn.Embedding whose weight is allocated but not initialised: the loader fills it.
    nn.Embedding's own random init, on the meta device the loader builds models on, runs
    torch's reference normal_, whose first call imports torch._dynamo: a second of every
    engine's start-up for numbers that are thrown away."""
    return nn.Embedding(vocab_size, hidden_size, _weight=torch.empty(vocab_size, hidden_size))


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and cast back before the weight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = layer_ops()
        if fused is not None and fused.takes(x, self.weight):  # bfloat16 on the CPU
            return fused.rms_norm(x, self.weight, self.eps)
        if x.dtype != torch.float32:
            h = x.float()
            return self.weight * (h * _inverse_rms(h, self.eps)).to(x.dtype)
        return self.weight * (x * _inverse_rms(x, self.eps))

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """x += delta in place (the residual stream), then the norm of x: one call on the
        CPU in bfloat16."""
        fused = layer_ops()
        if fused is not None and fused.takes(x, self.weight):
            return fused.rms_norm(x, self.weight, self.eps, delta)
        return self(x.add_(delta))


def _inverse_rms(h: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(mean(h^2) + eps) over the last dim (in place on the fresh mean: no copies)."""
    return h.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), the SwiGLU feed-forward of Llama and Qwen.

    gate_proj and up_proj load by their checkpoint names and run as one
    gate_up_proj once the loader has fused them (kvserve.model.quant.fusion).
    """

    FUSED_PROJECTIONS: ClassVar[dict[str, tuple[str, ...]]] = {
        "gate_up_proj": ("gate_proj", "up_proj")
    }
    gate_up_proj: nn.Module  # set by the fusion

    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        fused = layer_ops() if type(self).activation is GatedMLP.activation else None
        if fused is not None and (hidden := fused.silu_mul(gate_up)) is not None:
            return self.down_proj(hidden)
        gate, up = gate_up.view(*x.shape[:-1], 2, -1).unbind(-2)
        return self.down_proj(self.activation(gate) * up)

    def activation(self, gate: torch.Tensor) -> torch.Tensor:
        return nn.functional.silu(gate)


def rope_inv_freq(
    rope: RopeConfig, head_dim: int, device: torch.device, divisors: tuple[float, ...] = ()
) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, with linear or Llama 3.1 scaling, or
    longrope's per-frequency `divisors`."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    if divisors:
        if len(divisors) != head_dim // 2:
            raise ValueError(f"{len(divisors)} longrope factors for {head_dim} rotary dims")
        factors = torch.tensor(divisors, dtype=torch.float32, device=device)
        return 1.0 / (factors * rope.theta**exponents)
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.scaling_type == "linear":
        return inv_freq / rope.factor
    if rope.scaling_type == "llama3":
        # Long wavelengths are slowed down by `factor`, short ones kept, the band
        # in between interpolated smoothly (Llama 3.1's context extension).
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding:
    """cos/sin tables for arbitrary positions (a batch mixes many sequences).

    longrope (kvserve.model.checkpoint.longrope) keeps two frequency sets and picks one per
    token by its position; its attention factor scales cos and sin.
    """

    def __init__(self, rope: RopeConfig, head_dim: int, device: torch.device) -> None:
        self.long_inv_freq: torch.Tensor | None = None
        self.attention_factor = rope.attention_factor
        self.original_max_position = rope.original_max_position_embeddings
        if rope.scaling_type == "longrope":
            self.inv_freq = rope_inv_freq(rope, head_dim, device, rope.short_factor)
            self.long_inv_freq = rope_inv_freq(rope, head_dim, device, rope.long_factor)
        else:
            self.inv_freq = rope_inv_freq(rope, head_dim, device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """[T, 1, rotary_dim] cos and signed sin (-sin on the first half) for the given
        token positions: built once per step, for every layer and head (`apply_rotary`)."""
        inv_freq = self.inv_freq
        if self.long_inv_freq is not None:
            past = (positions >= self.original_max_position)[:, None, None]
            inv_freq = torch.where(past, self.long_inv_freq, self.inv_freq)
        freqs = positions[:, None, None].float() * inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, heads, rotary_dim] by the tables of `RotaryEmbedding.cos_sin`.

    The reference's x * cos + cat(-x2, x1) * sin, as x * cos + cat(x2, x1) * signed_sin:
    the same products (a sign moves exactly), in four torch calls. roll gives cat(x2, x1)
    faster than flip or cat (10.7 against 16.6 and 13.6 us for 8 rows of 12 heads).
    """
    fused = layer_ops()
    if fused is not None and fused.rotates(x, cos):  # bfloat16 on the CPU: one call
        return fused.rotary(x, cos, signed_sin)
    rotated = x.roll(x.shape[-1] // 2, -1).mul_(signed_sin)  # cat(x2, x1) * signed_sin
    return rotated.add_(x * cos)


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dims of [T, heads, head_dim]; the rest pass unchanged."""
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return apply_rotary(x, cos, sin)
    return torch.cat((apply_rotary(x[..., :dim], cos, sin), x[..., dim:]), dim=-1)
