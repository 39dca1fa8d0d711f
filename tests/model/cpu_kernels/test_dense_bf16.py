"""bfloat16 weights in panels times bfloat16 rows on AVX-512 BF16 (dense_bf16.h, through
quant_matmul's bits 16), and DenseBf16Linear, the layer that runs it at every row count."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvserve.engine.engine_args import EXACT_ENV
from kvserve.model import ModelRunner
from kvserve.model.cpu_kernels import quant_matmul
from kvserve.model.quant.dense_bf16_linear import (
    DenseBf16Linear,
    dense_bf16_available,
    pack_panels,
    unpack_panels,
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


def dense(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The kernel on w's panels."""
    assert KERNEL is not None
    return KERNEL.dense(x, pack_panels(w), w.shape[0])


@pytest.mark.parametrize(("n", "k"), [(16, 2), (17, 3), (1, 1), (130, 576)])
def test_panels_hold_the_weight(n, k):
    """Panel p, pair j, lane i, c: w[16p + i, 2j + c]; zeros past N and K; and back."""
    w = torch.randn(n, k).bfloat16()
    panels = pack_panels(w)
    assert panels.shape == ((n + 15) // 16, (k + 1) // 2, 16, 2)
    p, j, i, c = (n - 1) // 16, (k - 1) // 2, (n - 1) % 16, (k - 1) % 2
    assert panels[p, j, i, c] == w[n - 1, k - 1] and panels[0, 0, 0, 0] == w[0, 0]
    assert int((panels != 0).sum()) == int((w != 0).sum())
    assert torch.equal(unpack_panels(panels, n, k), w)


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 97, 200])
@pytest.mark.parametrize(("n", "k"), [(96, 64), (33, 576), (7, 81), (130, 40), (200, 3)])
def test_the_products_of_the_bfloat16_values_summed_in_float32(rows, n, k):
    """Against float64 sums of the same bfloat16 values: within float32's summing error,
    rounded once to bfloat16 (at most one bfloat16 step apart). N not a multiple of 16 or
    of a tile's 64 columns (masked stores), odd K (the last pair's one column), rows past
    a tile's 6 and a chunk's 96."""
    x, w = operands(rows, n, k, seed=rows * k + n)
    exact = x.double() @ w.double().T
    got = dense(x, w)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    step = exact.abs().clamp_min(1e-2) * 2.0**-7  # one bfloat16 step, relative
    assert ((got.double() - exact).abs() <= step).all()
    near = ((got.double() - exact).abs() <= exact.abs() * 2.0**-8 + 1e-6).float().mean()
    assert near > 0.95  # nearly all are the rounded exact sum itself


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_row_never_depends_on_its_batch_or_the_threads(threads):
    x, w = operands(203, 150, 200, seed=3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole = dense(x, w)
        torch.set_num_threads(threads)
        assert torch.equal(dense(x, w), whole)
        for start, stop in [(0, 1), (5, 6), (3, 11), (8, 23), (0, 16), (90, 203)]:
            assert torch.equal(dense(x[start:stop].contiguous(), w), whole[start:stop])
    finally:
        torch.set_num_threads(before)


def test_a_swapped_weight_row_or_column_shows():
    """The reference test above is not blind to layout mistakes."""
    x, w = operands(4, 16, 96, seed=5)
    base = dense(x, w)
    assert not torch.equal(dense(x, w[[1, 0, *range(2, 16)]].contiguous()), base)
    assert not torch.equal(dense(x, w[:, [1, 0, *range(2, 96)]].contiguous()), base)


def test_non_finite_values_and_an_odd_k_past_the_row():
    """An odd K's last pair reads one column: the next row's first value (here infinite)
    never meets the padding's zero (0 x inf would be NaN); a NaN input stays NaN."""
    x, w = operands(3, 20, 5, seed=9)
    x[1, 0] = float("inf")
    got = dense(x, w)
    assert torch.isfinite(got[0]).all() and torch.isfinite(got[2]).all()
    x[2, 4] = float("nan")
    assert dense(x, w)[2].isnan().all()


def test_rounding_to_bfloat16_is_to_nearest_ties_to_even():
    """Sums exact in float32 that fall halfway between two bfloat16 values round as torch
    rounds them: 1 + 2^-8 down to 1 (even), 1 + 2^-7 + 2^-8 up to 1 + 2^-6."""
    w = torch.tensor([[1.0, 1.0], [1.0, -1.0]]).bfloat16()
    x = torch.tensor([[1.0, 2**-8], [1 + 2**-7, 2**-8], [-1.0, -(2**-8)], [3.0, 2**-6]])
    want = (x.float() @ w.float().T).bfloat16()
    assert torch.equal(dense(x.bfloat16(), w), want)
    assert want[0, 0] == 1.0 and want[1, 0] == 1 + 2**-6  # the ties themselves


def test_the_kernel_refuses_panels_of_another_shape():
    x, w = operands(2, 40, 64, seed=1)
    assert KERNEL is not None
    with pytest.raises(ValueError, match="hold no"):
        KERNEL.dense(x, pack_panels(w), 60)
    with pytest.raises(ValueError, match="input for panels"):
        KERNEL.dense(x[:, :60].contiguous(), pack_panels(w), 40)


def test_the_layer_runs_the_kernel_at_every_row_count():
    x, w = operands(300, 48, 128, seed=7)
    bias = torch.randn(48).bfloat16()
    layer = DenseBf16Linear(w, bias)
    assert torch.equal(layer(x), dense(x, w).add_(bias))
    assert torch.equal(layer.weight, w)
    assert layer(x[:3].view(1, 3, 128)).shape == (1, 3, 48)
    assert torch.equal(layer(x.float()), nn.functional.linear(x.float(), w.float(), bias.float()))


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
    assert len(said) == 1 and "; matmuls on kvserve's AVX-512 BF16 kernel" in said[0]
    exact = runner(path, exact=True)
    assert fast.model is not None and exact.model is not None
    kinds = {type(m) for m in fast.model.modules() if isinstance(m, nn.Linear | DenseBf16Linear)}
    assert kinds == {DenseBf16Linear}
    embeddings = fast.model.get_parameter("model.embed_tokens.weight")
    assert torch.equal(fast.model.lm_head.weight, embeddings)  # tied: its panels are theirs
    assert isinstance(exact.model.lm_head, OneDNNLinear | nn.Linear)
    assert not any(isinstance(m, DenseBf16Linear) for m in exact.model.modules())
