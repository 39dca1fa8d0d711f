"""Stacked projections (kvserve.model.quant.fusion): one layer computing what its parts did."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvserve.model.quant.fusion import LinearParts, stack_linears
from kvserve.model.quant.quant_linear import Int4Linear, Int8Linear


def linears(rows: list[int], columns: int = 64, bias: bool = True) -> list[nn.Linear]:
    torch.manual_seed(sum(rows))
    return [nn.Linear(columns, n, bias=bias) for n in rows]


def outputs(parts: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    return torch.cat([part(x) for part in parts], dim=-1)


def test_float_parts_become_one_linear_holding_their_rows():
    parts = linears([128, 64, 64])
    fused = stack_linears(parts)
    assert type(fused) is nn.Linear
    assert torch.equal(fused.weight, torch.cat([p.weight for p in parts]))
    assert torch.equal(fused.bias, torch.cat([p.bias for p in parts]))
    x = torch.randn(5, 64)
    with torch.inference_mode():
        torch.testing.assert_close(fused(x), outputs(parts, x))


@pytest.mark.parametrize("bias", [True, False])
def test_int8_parts_stack_rows_and_scales_exactly(bias):
    parts = [Int8Linear.quantize(p.weight, p.bias) for p in linears([48, 16], bias=bias)]
    fused = stack_linears(parts)
    assert isinstance(fused, Int8Linear) and fused.out_features == 64
    assert torch.equal(fused.dequantized(), torch.cat([p.dequantized() for p in parts]))
    x = torch.randn(3, 64)
    with torch.inference_mode():
        assert torch.equal(fused(x), outputs(parts, x))


def test_int4_parts_stack_rows_exactly():
    """Packed rows are independent (any count): the stacked layer's weights are the parts'
    exactly, and so are its outputs (a row's sums do not depend on its neighbours)."""
    rows = [48, 8, 17]
    parts = [Int4Linear.quantize(p.weight, p.bias) for p in linears(rows)]
    fused = stack_linears(parts)
    assert isinstance(fused, Int4Linear) and fused.out_features == sum(rows)
    assert torch.equal(fused.dequantized(), torch.cat([p.dequantized() for p in parts]))
    x = torch.randn(3, 64)
    with torch.inference_mode():
        assert torch.equal(fused(x), outputs(parts, x))


def test_parts_that_cannot_stack_run_one_by_one():
    """Kinds that differ, or int4 scales of two dtypes (a GGUF file's Q4_0 and Q4_K):
    LinearParts."""
    x = torch.randn(2, 64)
    int4 = [Int4Linear.quantize(p.weight, None) for p in linears([48, 64], bias=False)]
    wide = Int4Linear.from_codes(
        torch.randint(0, 16, (16, 64)), torch.rand(16, 2), torch.rand(16, 2), None
    )
    mixed = [int4[0], Int8Linear.quantize(linears([16])[0].weight, None)]
    for parts in ([int4[0], wide], mixed):
        fused = stack_linears(parts)
        assert isinstance(fused, LinearParts)
        with torch.inference_mode():
            assert torch.equal(fused(x), outputs(parts, x))
    assert Int4Linear.stacked([int4[0], wide]) is None
    assert isinstance(Int4Linear.stacked(int4), Int4Linear)
