"""bfloat16 weights times few bfloat16 rows on AVX-512 BF16 (dense_bf16.h, through
quant_matmul's bits 16), and DenseBf16Linear, the layer that runs it below
DENSE_BF16_ROWS rows and F.linear above."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvserve.engine.engine_args import EXACT_ENV
from kvserve.model import ModelRunner
from kvserve.model.cpu_kernels import quant_matmul
from kvserve.model.quant.dense_bf16_linear import (
    DENSE_BF16_ROWS,
    DenseBf16Linear,
    dense_bf16_available,
)
from kvserve.model.quant.onednn_linear import OneDNNLinear

quant_matmul.enable()
KERNEL = quant_matmul.kernel()
pytestmark = pytest.mark.skipif(
    KERNEL is None or not KERNEL.dense_bf16, reason="no AVX-512 BF16 kernel on this CPU"
)


def operands(rows: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, k, generator=gen).bfloat16(),
            torch.randn(n, k, generator=gen).bfloat16())  # fmt: skip


@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 15, 17])
@pytest.mark.parametrize(("n", "k"), [(96, 64), (33, 576), (7, 80), (130, 40)])
def test_the_products_of_the_bfloat16_values_summed_in_float32(rows, n, k):
    """Against float64 sums of the same bfloat16 values: within float32's summing error,
    rounded once to bfloat16 (at most one bfloat16 step apart). Odd N (a last single
    weight row), K not a multiple of 32 (masked columns), more rows than one pass."""
    assert KERNEL is not None
    x, w = operands(rows, n, k, seed=rows * k + n)
    exact = x.double() @ w.double().T
    got = KERNEL.dense(x, w)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    step = exact.abs().clamp_min(1e-2) * 2.0**-7  # one bfloat16 step, relative
    assert ((got.double() - exact).abs() <= step).all()
    near = ((got.double() - exact).abs() <= exact.abs() * 2.0**-8 + 1e-6).float().mean()
    assert near > 0.95  # nearly all are the rounded exact sum itself


def test_a_row_never_depends_on_its_batch():
    assert KERNEL is not None
    x, w = operands(23, 50, 200, seed=3)
    whole = KERNEL.dense(x, w)
    for start, stop in [(0, 1), (5, 6), (3, 11), (8, 23), (0, 16)]:
        assert torch.equal(KERNEL.dense(x[start:stop].contiguous(), w), whole[start:stop])


def test_a_swapped_weight_row_or_column_shows():
    """The reference test above is not blind to layout mistakes."""
    assert KERNEL is not None
    x, w = operands(4, 16, 96, seed=5)
    base = KERNEL.dense(x, w)
    assert not torch.equal(KERNEL.dense(x, w[[1, 0, *range(2, 16)]].contiguous()), base)
    assert not torch.equal(KERNEL.dense(x, w[:, [1, 0, *range(2, 96)]].contiguous()), base)


def test_the_layer_runs_the_kernel_below_its_rows_and_f_linear_above():
    x, w = operands(DENSE_BF16_ROWS + 4, 48, 128, seed=7)
    bias = torch.randn(48).bfloat16()
    layer = DenseBf16Linear(w, bias)
    assert KERNEL is not None
    few = x[: DENSE_BF16_ROWS - 1]
    assert torch.equal(layer(few), KERNEL.dense(few, w).add_(bias))
    assert torch.equal(layer(x), nn.functional.linear(x, w, bias))
    assert layer(x[:3].view(1, 3, 128)).shape == (1, 3, 48)


def runner(path: str, exact: bool) -> ModelRunner:
    return ModelRunner(path, block_size=4, num_blocks=32, dtype="bfloat16", num_threads=1,
                       exact=exact)  # fmt: skip


def test_a_fast_bfloat16_model_takes_the_layer_and_the_exact_mode_keeps_onednn(
    checkpoints, monkeypatch, caplog
):
    monkeypatch.delenv(EXACT_ENV)  # the suite runs exact; the users' default is not
    caplog.set_level("INFO", logger="kvserve")
    assert dense_bf16_available(torch.bfloat16, torch.device("cpu"), exact=False)
    path = checkpoints["qwen2"].path  # tied embeddings
    fast = runner(path, exact=False)
    said = [r.getMessage() for r in caplog.records if "dtype bfloat16" in r.getMessage()]
    assert len(said) == 1 and "decode matmuls on kvserve's AVX-512 BF16 kernel" in said[0]
    exact = runner(path, exact=True)
    assert fast.model is not None and exact.model is not None
    kinds = {type(m) for m in fast.model.modules() if isinstance(m, nn.Linear | DenseBf16Linear)}
    assert kinds == {DenseBf16Linear}
    embeddings = fast.model.get_parameter("model.embed_tokens.weight")
    assert fast.model.lm_head.weight.data_ptr() == embeddings.data_ptr()  # no copy
    assert isinstance(exact.model.lm_head, OneDNNLinear | nn.Linear)
    assert not any(isinstance(m, DenseBf16Linear) for m in exact.model.modules())
