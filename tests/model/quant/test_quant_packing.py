"""Packed weights: the error int8 and int4 may make, and GGUF blocks that map exactly.

The bounds are the quantizers' own: a weight moves by at most half a step
(its row's scale in int8, its block's in int4), so an output moves by at most
sum_k |x_k| * step / 2; the kernel's int8 activations move each input by at most
half its block's step (max |x| / 127 / 2), which adds sum_k |w_k| * dx_k / 2.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from kvserve.model.checkpoint.gguf_file import open_gguf
from kvserve.model.checkpoint.gguf_weights import tensor_shape, unpermute_rows
from kvserve.model.cpu_kernels import quant_matmul
from kvserve.model.quant.gguf_blocks import int4_blocks, int4_linear, keeps_blocks
from kvserve.model.quant.quant_linear import (
    DENSE_ROWS,
    DENSE_ROWS_LONG_FLOAT32,
    DENSE_ROWS_ON_TILES,
    Int4Linear,
    Int8Linear,
    dense_rows,
    fits,
    long_rows,
)
from kvserve.model.quant.quantize import check_quantization
from tests.model.gguf_files import encode
from tests.model.smollm2 import PATH as SMOLLM2
from tests.model.smollm2 import needs_smollm2


def random_linear(out_features: int, in_features: int, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features)
    with torch.no_grad():  # a few outlier columns, as trained weights have
        linear.weight[:, :3] *= 8
    return linear


def activation_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[M, N]: what rounding x to int8 per block of 32 may move each output by."""
    step = x.abs().view(x.shape[0], -1, 32).amax(-1) / 127
    return (step.repeat_interleave(32, 1) / 2) @ weight.abs().T


def test_int8_moves_each_weight_by_at_most_half_its_row_step():
    linear = random_linear(48, 192)
    packed = Int8Linear.quantize(linear.weight, linear.bias)
    w = linear.weight.detach()
    step = w.abs().amax(dim=1) / 127
    assert torch.equal(packed.scales, step)
    error = (packed.dequantized() - w).abs()
    assert (error <= step[:, None] / 2 * (1 + 1e-6)).all()
    assert error.max() > step.min() / 10, "a lossless result would mean nothing was rounded"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_output_is_the_float_layer_within_the_rounding_bound(dtype):
    linear = random_linear(48, 192)
    x = torch.randn(7, 192)
    packed = Int8Linear.quantize(linear.weight, linear.bias)
    step = packed.scales.float()
    bound = x.abs() @ (step[:, None].expand(48, 192) / 2).T
    bound += activation_bound(x, linear.weight.detach() + step[:, None] / 2)
    with torch.inference_mode():
        out, expected = packed(x.to(dtype)), linear(x)
    error = (out.float() - expected).abs()
    if dtype == torch.bfloat16:  # its input and output rounded too
        bound += 2**-7 * (x.abs() @ linear.weight.abs().T) + 2**-8 * expected.abs()
    assert (error <= bound * (1 + 1e-4) + 1e-5).all()
    assert out.dtype == dtype and packed(x[0].to(dtype)).shape == (48,)


def test_int4_moves_each_weight_by_at_most_half_its_block_step():
    linear = random_linear(32, 256)
    packed = Int4Linear.quantize(linear.weight, linear.bias)
    assert packed.scales.dtype == packed.offsets.dtype == torch.float16
    w = linear.weight.detach().view(32, 8, 32)
    step = packed.scales.float()
    assert (step >= (w.amax(-1) - w.amin(-1)) / 15).all()  # rounded up: the levels span it
    assert (step <= (w.amax(-1) - w.amin(-1)) / 15 * (1 + 2**-9)).all()
    error = (packed.dequantized().view(32, 8, 32) - w).abs()
    assert (error <= step[..., None] / 2 + w.abs().amax(-1, keepdim=True) * 2**-9).all()
    x = torch.randn(5, 256)
    bound = x.abs() @ (step.repeat_interleave(32, 1) / 2).T
    bound += activation_bound(x, packed.dequantized())
    with torch.inference_mode():
        assert ((packed(x) - linear(x)).abs() <= bound * 1.01 + 1e-5).all()


def test_packing_refuses_widths_the_kernel_cannot_run():
    assert fits(64) and fits(576) and not fits(48) and not fits(200) and not fits(0)
    for quantize in (Int4Linear.quantize, Int8Linear.quantize):
        with pytest.raises(ValueError, match="multiple of 64 input columns, got 200"):
            quantize(torch.randn(16, 200), None)


@pytest.fixture
def integer_kernel():
    """The kernel with its AMX tiles off, as on a CPU without AMX (restored after)."""
    quant_matmul.enable()
    kernel = quant_matmul.kernel()
    assert kernel is not None
    tiles = kernel.tile_rows
    kernel.use_tiles(False)
    yield kernel
    kernel.use_tiles(tiles > 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_rows_multiply_the_dequantized_weights(dtype, integer_kernel):
    """From DENSE_ROWS rows the input keeps its float values: the dtype's own matmul by the
    same weights (columns in the packed order, the sums in another order: float rounding)."""
    assert dense_rows(dtype, 576) == DENSE_ROWS[dtype]
    linear = random_linear(40, 576)
    rows = DENSE_ROWS[dtype]
    x = torch.randn(rows + 3, 576).to(dtype)
    for packed in (
        Int4Linear.quantize(linear.weight, None),
        Int8Linear.quantize(linear.weight, None),
    ):
        expected = x.float() @ packed.dequantized().T
        with torch.inference_mode():
            many, few = packed(x), packed(x[: rows - 1])
        assert many.dtype == dtype
        tolerance = 1e-4 if dtype == torch.float32 else 2**-6
        assert torch.allclose(
            many.float(), expected, rtol=tolerance, atol=tolerance * expected.abs().max()
        )
        assert not torch.equal(few, many[: rows - 1])  # the kernel's int8 activations round
        assert (
            (few.float() - expected[: rows - 1]).abs()
            <= activation_bound(x[: rows - 1].float(), packed.dequantized()) * 1.01
            + 2**-6 * expected.abs().max()
        ).all()


def test_long_float32_rows_stay_on_the_integer_kernel_on_avx512(integer_kernel):
    """float32 layers of long rows keep the integer kernel to DENSE_ROWS_LONG_FLOAT32 rows
    where it runs AVX-512 VNNI (there it beats the dense float32 matmul far longer): the
    bits of the kernel itself, row for row; short rows and bfloat16 keep DENSE_ROWS."""
    assert [long_rows(k) for k in (576, 896, 1024, 4864, 8192)] == [False, True, True, True, True]
    if integer_kernel.path != "avx512-vnni":
        assert dense_rows(torch.float32, 1024) == DENSE_ROWS[torch.float32]
        pytest.skip(f"the kernel runs {integer_kernel.path} here")
    assert dense_rows(torch.float32, 1024) == DENSE_ROWS_LONG_FLOAT32 > DENSE_ROWS[torch.float32]
    assert dense_rows(torch.float32, 576) == DENSE_ROWS[torch.float32]
    assert dense_rows(torch.bfloat16, 1024) == DENSE_ROWS[torch.bfloat16]
    packed = Int4Linear.quantize(random_linear(40, 1024).weight, None)
    x = torch.randn(DENSE_ROWS[torch.float32] + 5, 1024)
    with torch.inference_mode():
        many = packed(x)
        alone = torch.cat([packed(x[i : i + 1]) for i in range(0, len(x), 37)])
    assert torch.equal(many[::37], alone)  # no float matmul's blocking: the kernel's bits
    assert torch.equal(many, integer_kernel(x, packed.codes, packed.scales, packed.offsets))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_on_amx_tiles_in_a_layer(dtype):
    """Where the CPU has AMX, a layer's calls of the kernel's tile_rows rows or more run on
    its tiles (bfloat16 products) up to the tiles' dense rows; fewer rows stay on VNNI."""
    quant_matmul.enable()
    kernel = quant_matmul.kernel()
    if kernel is None or kernel.tile_rows == 0:
        pytest.skip("no AMX tiles on this CPU")
    assert dense_rows(dtype, 576) == DENSE_ROWS_ON_TILES[dtype] > DENSE_ROWS[dtype]
    packed = Int4Linear.quantize(random_linear(40, 576).weight, None)
    x = torch.randn(kernel.tile_rows + 6, 576).to(dtype)
    weights = packed.dequantized().bfloat16().double()
    expected = x.bfloat16().double() @ weights.T
    with torch.inference_mode():
        many, few = packed(x), packed(x[: kernel.tile_rows - 1])
    scale = expected.abs().amax(1, keepdim=True)
    assert ((many.double() - expected).abs() / scale).max() < (
        1e-5 if dtype == torch.float32 else 2**-7
    )
    assert not torch.equal(few, many[: kernel.tile_rows - 1])  # VNNI's int8 activations


def test_without_the_kernel_a_layer_dequantizes_the_same_weights(monkeypatch):
    """KVSERVE_CPU_KERNELS=0 or no compiler: float activations times the same weights."""
    linear = random_linear(24, 128)
    x = torch.randn(3, 128)
    for packed in (
        Int4Linear.quantize(linear.weight, None),
        Int8Linear.quantize(linear.weight, None),
    ):
        with torch.inference_mode():
            fast = packed(x)
            monkeypatch.setattr(quant_matmul, "_kernel", None)
            slow = packed(x)
            monkeypatch.undo()
        torch.testing.assert_close(slow, x @ packed.dequantized().T)
        assert not torch.equal(fast, slow)  # the kernel's int8 activations round
        assert ((fast - slow).abs() <= activation_bound(x, packed.dequantized()) * 1.01).all()


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q4_K], ids=lambda t: t.name)
def test_gguf_4bit_blocks_are_the_kernels_weights_bit_for_bit(qtype):
    """The file's codes, scales and mins go to the kernel as they are: with float32 scales its
    weights are gguf-py's dequantization exactly (not merely close)."""
    rng = np.random.default_rng(1)
    array = rng.normal(0, 0.05, (48, 512)).astype(np.float32)
    array[:, 7] += 0.4  # blocks whose minimum is far from zero
    stored, decoded = encode(array, qtype, rng)
    codes, scales, offsets = int4_blocks(np.asarray(stored).reshape(48, -1), qtype)
    assert codes.min() >= 0 and codes.max() <= 15 and len(np.unique(codes)) == 16
    packed = Int4Linear.from_codes(*map(torch.from_numpy, (codes, scales, offsets)), None)
    assert torch.equal(packed.dequantized(), torch.from_numpy(decoded))


def test_other_types_do_not_claim_to_map():
    with pytest.raises(ValueError, match="Q8_0 blocks do not map"):
        int4_blocks(np.zeros((16, 34), np.uint8), T.Q8_0)


@needs_smollm2
def test_default_model_q4_1_weights_repack_bit_for_bit():
    """SmolLM2's own Q4_1 tensors, q rows put back in transformers' order as the loader does."""
    reader = open_gguf(SMOLLM2)
    tensors = {t.name: t for t in reader.tensors}
    for name, heads in (("blk.0.attn_q.weight", 9), ("blk.29.ffn_down.weight", None)):
        tensor = tensors[name]
        assert tensor.tensor_type == T.Q4_1 and keeps_blocks(tensor)
        expected = dequantize(tensor.data, tensor.tensor_type).reshape(tensor_shape(tensor))
        if heads is not None:
            expected = unpermute_rows(expected, heads)
        packed = int4_linear(tensor, None, heads)
        assert torch.equal(packed.dequantized(), torch.from_numpy(expected)), name
        assert packed.scales.dtype == packed.offsets.dtype == torch.float16  # the file's own
    assert not keeps_blocks(tensors["token_embd.weight"])  # Q8_0: requantized, not kept


def test_quantization_is_checked_before_anything_loads():
    check_quantization("int4", torch.device("cpu"))
    with pytest.raises(ValueError, match="one of none, int8, int4, gguf, got 'int3'"):
        check_quantization("int3", torch.device("cpu"))
    for mode in ("int8", "int4", "gguf"):
        with pytest.raises(ValueError, match=f"{mode!r} runs kvserve's CPU kernel only"):
            check_quantization(mode, torch.device("cuda"))
    check_quantization("none", torch.device("cuda"))
