"""bfloat16 and float32 weights in panels times rows of their dtype (dense_bf16.h on
AVX-512 BF16, dense_f32.h on AVX-512 or AVX2, through quant_matmul's bits 16 and 32), and
PanelLinear, the layer that runs them at every row count."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvserve.engine.engine_args import EXACT_ENV
from kvserve.model import ModelRunner
from kvserve.model.cpu_kernels import quant_matmul
from kvserve.model.quant.onednn_linear import OneDNNLinear
from kvserve.model.quant.panel_linear import (
    PanelLinear,
    pack_panels,
    panels_available,
    unpack_panels,
)

quant_matmul.enable()
KERNEL = quant_matmul.kernel()
BF16 = pytest.param(
    torch.bfloat16,
    marks=pytest.mark.skipif(
        KERNEL is None or not KERNEL.dense_bf16, reason="no AVX-512 BF16 kernel on this CPU"
    ),
    id="bfloat16",
)
F32 = pytest.param(
    torch.float32,
    marks=pytest.mark.skipif(
        KERNEL is None or not KERNEL.dense_f32, reason="no AVX2 or AVX-512 kernel on this CPU"
    ),
    id="float32",
)
DTYPES = [BF16, F32]


def operands(rows: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, k, generator=gen).to(dtype),
            torch.randn(n, k, generator=gen).to(dtype))  # fmt: skip


def dense(x: torch.Tensor, w: torch.Tensor, kernel=None) -> torch.Tensor:
    """The kernel on w's panels."""
    kernel = kernel or KERNEL
    assert kernel is not None
    return kernel.dense(x, pack_panels(w), w.shape[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), [(16, 2), (17, 3), (1, 1), (130, 576)])
def test_panels_hold_the_weight(dtype, n, k):
    """Panel p, line j, lane i, c: w[16p + i, g j + c] (g: 2 bfloat16 pairs, 1 float32);
    zeros past N and K; and back."""
    w = torch.randn(n, k).to(dtype)
    g = 2 if dtype == torch.bfloat16 else 1
    panels = pack_panels(w)
    assert panels.shape == ((n + 15) // 16, (k + g - 1) // g, 16, g)
    p, j, i, c = (n - 1) // 16, (k - 1) // g, (n - 1) % 16, (k - 1) % g
    assert panels[p, j, i, c] == w[n - 1, k - 1] and panels[0, 0, 0, 0] == w[0, 0]
    assert int((panels != 0).sum()) == int((w != 0).sum())
    assert torch.equal(unpack_panels(panels, n, k), w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 7, 97, 200])
@pytest.mark.parametrize(("n", "k"), [(96, 64), (33, 576), (7, 81), (130, 40), (200, 3)])
def test_the_products_summed_in_float32(dtype, rows, n, k):
    """Against float64 sums of the same values: bfloat16 within one step of its rounding
    (nearly all the rounded exact sum itself); float32 within the chain's rounding error.
    N not a multiple of 16 or of a tile's columns (masked stores), odd K (bfloat16's last
    pair's one column), rows past a tile's 6 and a chunk's 96."""
    x, w = operands(rows, n, k, dtype, seed=rows * k + n)
    exact = x.double() @ w.double().T
    got = dense(x, w)
    assert got.shape == (rows, n) and got.dtype == dtype
    error = (got.double() - exact).abs()
    if dtype == torch.float32:
        assert (error <= (x.double().abs() @ w.double().abs().T) * k * 2.0**-24).all()
        return
    assert (error <= exact.abs().clamp_min(1e-2) * 2.0**-7).all()  # one bfloat16 step
    assert ((error <= exact.abs() * 2.0**-8 + 1e-6).float().mean()) > 0.95


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [1, 3])
def test_a_row_never_depends_on_its_batch_or_the_threads(dtype, threads):
    x, w = operands(203, 150, 200, dtype, seed=3)
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


@pytest.mark.skipif(KERNEL is None or KERNEL.path != "avx512-vnni", reason="no AVX-512 here")
def test_float32_gives_the_same_bits_on_avx2():
    """One fma chain per output whatever the vector width: the AVX2 build (`-mno-avx512f`)
    gives the AVX-512 build's bits."""
    avx2 = quant_matmul.build_variant(("-mno-avx512f",))
    assert avx2 is not None and avx2.dense_f32 and avx2.path.startswith("avx2")
    x, w = operands(37, 90, 130, torch.float32, seed=11)
    assert torch.equal(dense(x, w, avx2), dense(x, w))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_swapped_weight_row_or_column_shows(dtype):
    """The reference test above is not blind to layout mistakes."""
    x, w = operands(4, 16, 96, dtype, seed=5)
    base = dense(x, w)
    assert not torch.equal(dense(x, w[[1, 0, *range(2, 16)]].contiguous()), base)
    assert not torch.equal(dense(x, w[:, [1, 0, *range(2, 96)]].contiguous()), base)


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_values_and_an_odd_k_past_the_row(dtype):
    """An odd K's last bfloat16 pair reads one column: the next row's first value (here
    infinite) never meets the padding's zero (0 x inf would be NaN); a NaN stays NaN."""
    x, w = operands(3, 20, 5, dtype, seed=9)
    x[1, 0] = float("inf")
    got = dense(x, w)
    assert torch.isfinite(got[0]).all() and torch.isfinite(got[2]).all()
    x[2, 4] = float("nan")
    assert dense(x, w)[2].isnan().all()


@pytest.mark.parametrize("dtype", [BF16])
def test_rounding_to_bfloat16_is_to_nearest_ties_to_even(dtype):
    """Sums exact in float32 that fall halfway between two bfloat16 values round as torch
    rounds them: 1 + 2^-8 down to 1 (even), 1 + 2^-7 + 2^-8 up to 1 + 2^-6."""
    w = torch.tensor([[1.0, 1.0], [1.0, -1.0]]).to(dtype)
    x = torch.tensor([[1.0, 2**-8], [1 + 2**-7, 2**-8], [-1.0, -(2**-8)], [3.0, 2**-6]])
    want = (x.float() @ w.float().T).to(dtype)
    assert torch.equal(dense(x.to(dtype), w), want)
    assert want[0, 0] == 1.0 and want[1, 0] == 1 + 2**-6  # the ties themselves


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_kernel_refuses_panels_of_another_shape(dtype):
    x, w = operands(2, 40, 64, dtype, seed=1)
    assert KERNEL is not None
    with pytest.raises(ValueError, match="hold no"):
        KERNEL.dense(x, pack_panels(w), 60)
    with pytest.raises(ValueError, match="input for panels"):
        KERNEL.dense(x[:, :60].contiguous(), pack_panels(w), 40)
    with pytest.raises(ValueError, match="input for panels"):
        KERNEL.dense(x.double(), pack_panels(w), 40)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_layer_runs_the_kernel_at_every_row_count(dtype):
    x, w = operands(300, 48, 128, dtype, seed=7)
    bias = torch.randn(48).to(dtype)
    layer = PanelLinear(w, bias)
    assert torch.equal(layer(x), dense(x, w).add_(bias))
    assert torch.equal(layer.weight, w)
    assert layer(x[:3].view(1, 3, 128)).shape == (1, 3, 48)
    wide = x.double()  # another dtype: F.linear on the unpacked weight
    assert torch.equal(layer(wide), nn.functional.linear(wide, w.double(), bias.double()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_fast_model_takes_the_layer_and_the_exact_mode_does_not(
    dtype, checkpoints, monkeypatch, caplog
):
    monkeypatch.delenv(EXACT_ENV)  # the suite runs exact; the users' default is not
    caplog.set_level("INFO", logger="kvserve")
    assert panels_available(dtype, torch.device("cpu"), exact=False)
    path = checkpoints["qwen2"].path  # tied embeddings
    name = str(dtype).removeprefix("torch.")

    def runner(exact: bool) -> ModelRunner:
        return ModelRunner(path, block_size=4, num_blocks=32, dtype=name, num_threads=1,
                           exact=exact)  # fmt: skip

    fast = runner(exact=False)
    said = [r.getMessage() for r in caplog.records if f"dtype {name}" in r.getMessage()]
    kind = "AVX-512 BF16" if dtype == torch.bfloat16 else "float32"
    assert len(said) == 1 and f"; matmuls on kvserve's {kind} kernel" in said[0]
    exact = runner(exact=True)
    assert fast.model is not None and exact.model is not None
    kinds = {type(m) for m in fast.model.modules() if isinstance(m, nn.Linear | PanelLinear)}
    assert kinds == {PanelLinear}
    embeddings = fast.model.get_parameter("model.embed_tokens.weight")
    assert torch.equal(fast.model.lm_head.weight, embeddings)  # tied: its panels are theirs
    exact_kinds = {type(m) for m in exact.model.modules() if isinstance(m, nn.Module)}
    assert PanelLinear not in exact_kinds  # bfloat16: OneDNNLinear; float32: F.linear's
    assert (OneDNNLinear in exact_kinds) == (dtype == torch.bfloat16)
