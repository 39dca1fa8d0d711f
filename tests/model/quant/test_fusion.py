"""Stacked projections (kvserve.model.quant.fusion): one layer computing what its parts did."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvserve.model.quant.fusion import LinearParts, stack_linears
from kvserve.model.quant.quant_linear import INT4_STACK_ROWS, Int4Linear, Int8Linear

BF16 = torch.bfloat16


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
    parts = [Int8Linear.quantize(p.weight, p.bias, BF16) for p in linears([48, 16], bias=bias)]
    fused = stack_linears(parts)
    assert isinstance(fused, Int8Linear) and fused.out_features == 64
    assert torch.equal(fused.dequantized(), torch.cat([p.dequantized() for p in parts]))
    x = torch.randn(3, 64)
    with torch.inference_mode():
        assert torch.equal(fused(x), outputs(parts, x))


def test_int4_parts_filling_the_packing_blocks_stack_as_packed():
    """Every part but the last fills whole blocks of rows: the packed bytes follow each
    other, and the stacked layer's weights are the parts' exactly."""
    rows = [2 * INT4_STACK_ROWS, INT4_STACK_ROWS, 16]
    parts = [Int4Linear.quantize(p.weight, p.bias, 32, BF16) for p in linears(rows)]
    fused = stack_linears(parts)
    assert isinstance(fused, Int4Linear) and fused.out_features == sum(rows)
    assert torch.equal(fused.dequantized(), torch.cat([p.dequantized() for p in parts]))
    x = torch.randn(3, 64)
    with torch.inference_mode():
        assert torch.equal(fused(x), outputs(parts, x))


def test_parts_that_cannot_stack_run_one_by_one():
    """Int4 rows that stop inside a packing block, or kinds that differ: LinearParts."""
    x = torch.randn(2, 64)
    ragged = [Int4Linear.quantize(p.weight, None, 32, BF16) for p in linears([48, 64], bias=False)]
    mixed = [ragged[0], Int8Linear.quantize(linears([16])[0].weight, None, BF16)]
    for parts in (ragged, mixed):
        fused = stack_linears(parts)
        assert isinstance(fused, LinearParts)
        with torch.inference_mode():
            assert torch.equal(fused(x), outputs(parts, x))
    assert Int4Linear.stacked(ragged) is None
