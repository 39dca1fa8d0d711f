"""The layers' small bfloat16 ops in C against torch's own: the rotation bit for bit,
the norm and SiLU-and-multiply to the last bit of a rare bfloat16 (a float32 sum's order,
glibc's exp against torch's), small batches and ones split across threads."""

from __future__ import annotations

import pytest
import torch

from kvserve.model.cpu_kernels import layer_ops
from kvserve.model.layers.common import GatedMLP, RMSNorm, apply_rotary

BF16 = torch.bfloat16


def assert_nearly_equal(out: torch.Tensor, expected: torch.Tensor) -> None:
    """The same bits but for a rare near neighbour (a float32 sum in another order, glibc's
    exp against torch's: a value a hair from a rounding midpoint may land on its other
    side, then the product): under 0.1 % of the numbers, within two bfloat16 steps."""
    assert out.dtype == expected.dtype == BF16 and out.shape == expected.shape
    differ = out != expected
    assert differ.float().mean().item() <= 1e-3, f"{int(differ.sum())} of {out.numel()} differ"
    steps = (expected.float().abs() * 2**-6).clamp(min=2**-133)  # two bfloat16 steps
    assert bool(((out.float() - expected.float()).abs() <= steps).all())


def torch_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layer_ops, "_ops", None)


@pytest.mark.parametrize(("rows", "dim"), [(1, 64), (8, 576), (3, 100), (200, 576)])
def test_the_norm_and_its_residual_add(fused, monkeypatch, rows, dim):
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(dim, 1e-5).to(BF16)
    norm.weight.data = torch.randn(dim, generator=gen).to(BF16)
    x = (3 * torch.randn(rows, dim, generator=gen)).to(BF16)
    delta = torch.randn(rows, dim, generator=gen).to(BF16)
    torch_ops(monkeypatch)
    expected_x = x + delta
    expected = norm(expected_x.clone())
    out_x = x.clone()
    out = fused.rms_norm(out_x, norm.weight, norm.eps, delta)
    assert torch.equal(out_x, expected_x)  # the residual add: bf16(x + delta) exactly
    assert_nearly_equal(out, expected)
    assert_nearly_equal(fused.rms_norm(expected_x.clone(), norm.weight, norm.eps), expected)
    with pytest.raises(ValueError, match=r"a residual of \(1, 2\)"):
        fused.rms_norm(x, norm.weight, norm.eps, delta[:1, :2])


@pytest.mark.parametrize(("rows", "heads"), [(1, 12), (8, 12), (300, 12)])
def test_the_rotation_is_bit_for_bit_on_a_strided_view(fused, monkeypatch, rows, heads):
    """q and k rotated out of a fused qkv row (its v heads skipped by the row stride)."""
    from kvserve.model.checkpoint.config import RopeConfig
    from kvserve.model.layers.common import RotaryEmbedding

    dim = 64
    gen = torch.Generator().manual_seed(heads + rows)
    qkv = torch.randn(rows, heads + 3, dim, generator=gen).to(BF16)
    x = qkv[:, :heads]
    rope = RotaryEmbedding(RopeConfig(theta=10000.0), dim, torch.device("cpu"))
    cos, sin = rope.cos_sin(torch.randint(0, 4000, (rows,), generator=gen), BF16)
    assert fused.rotates(x, cos) and not fused.rotates(x[..., :32], cos[..., :32])
    torch_ops(monkeypatch)
    assert torch.equal(fused.rotary(x, cos, sin), apply_rotary(x, cos, sin))


@pytest.mark.parametrize(("rows", "width"), [(1, 1536), (8, 1536), (64, 1536), (5, 40)])
def test_silu_and_multiply(fused, monkeypatch, rows, width):
    gen = torch.Generator().manual_seed(width + rows)
    gate_up = (4 * torch.randn(rows, 2 * width, generator=gen)).to(BF16)
    gate, up = gate_up.view(rows, 2, width).unbind(1)
    expected = torch.nn.functional.silu(gate) * up
    out = fused.silu_mul(gate_up)
    assert out is not None
    assert_nearly_equal(out, expected)
    assert fused.silu_mul(gate_up.float()) is None
    assert fused.silu_mul(gate_up[:, ::2]) is None


def test_a_layer_runs_them_when_they_are_on(fused, monkeypatch):
    """RMSNorm, the MLP and apply_rotary call the C ops only when they are enabled and
    the tensors are bfloat16 on the CPU."""
    calls: list[str] = []

    class Counting:
        def __getattr__(self, name):
            attr = getattr(fused, name)
            if name not in ("rms_norm", "rotary", "silu_mul"):
                return attr

            def counted(*args, **kwargs):
                out = attr(*args, **kwargs)
                if out is not None:  # silu_mul declines what it does not compute
                    calls.append(name)
                return out

            return counted

    mlp = GatedMLP(32, 48, bias=False).to(BF16)
    mlp.gate_up_proj = torch.nn.Linear(32, 96, bias=False).to(BF16)
    norm = RMSNorm(32, 1e-6).to(BF16)
    x = torch.randn(4, 32).to(BF16)
    torch_ops(monkeypatch)
    plain = mlp(norm(x))
    monkeypatch.setattr(layer_ops, "_ops", Counting())
    assert_nearly_equal(mlp(norm(x)), plain)
    assert calls == ["rms_norm", "silu_mul"]
    mlp.float(), norm.float()
    mlp(norm(x.float()))
    assert calls == ["rms_norm", "silu_mul"]  # float32 keeps torch's ops
