"""Packed weights: the error int8 and int4 may make, and GGUF blocks that map exactly.

The bounds are the quantizers' own: a weight moves by at most half a step
(its row's scale in int8, its group's in int4), so an output moves by at most
sum_k |x_k| * step / 2. The kernels compute in float32 here, to see the
packing alone; bfloat16 adds its own rounding, bounded separately.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from kvserve.model.checkpoint.gguf_file import open_gguf
from kvserve.model.checkpoint.gguf_weights import tensor_shape, unpermute_rows
from kvserve.model.quant.gguf_blocks import int4_blocks, int4_linear, keeps_blocks
from kvserve.model.quant.quant_linear import Int4Linear, Int8Linear, int4_fits, int8_fits
from kvserve.model.quant.quantize import check_quantization
from tests.model.gguf_files import encode
from tests.model.smollm2 import PATH as SMOLLM2
from tests.model.smollm2 import needs_smollm2

F32, BF16 = torch.float32, torch.bfloat16


def random_linear(out_features: int, in_features: int, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features)
    with torch.no_grad():  # a few outlier columns, as trained weights have
        linear.weight[:, :3] *= 8
    return linear


def test_int8_moves_each_weight_by_at_most_half_its_row_step():
    linear = random_linear(48, 208)
    packed = Int8Linear.quantize(linear.weight, linear.bias, F32)
    w = linear.weight.detach()
    step = w.abs().amax(dim=1) / 127
    assert torch.equal(packed.scales, step)
    error = (packed.dequantized() - w).abs()
    assert (error <= step[:, None] / 2 * (1 + 1e-6)).all()
    assert error.max() > step.min() / 10, "a lossless result would mean nothing was rounded"


def test_int8_output_is_the_float_layer_within_the_rounding_bound():
    linear = random_linear(48, 208)
    x = torch.randn(7, 208)
    for dtype in (F32, BF16):
        packed = Int8Linear.quantize(linear.weight, linear.bias, dtype)
        step = packed.scales.float()
        bound = x.abs() @ (step[:, None].expand(48, 208) / 2).T
        error = (packed(x) - linear(x)).abs()
        if dtype == F32:
            assert (error <= bound * (1 + 1e-5) + 1e-6).all()
        else:  # bfloat16 inputs and outputs: relative 2^-8 of each on top
            assert (error <= bound + 2**-7 * (x.abs() @ linear.weight.abs().T) + 1e-3).all()
        assert packed(x).dtype == x.dtype and packed(x[0]).shape == (48,)


def test_int4_moves_each_weight_by_at_most_half_its_group_step():
    linear = random_linear(32, 256)
    packed = Int4Linear.quantize(linear.weight, linear.bias, 32, F32)
    w = linear.weight.detach().view(32, 8, 32)
    step = (w.amax(-1) - w.amin(-1)) / 15
    error = (packed.dequantized().view(32, 8, 32) - w).abs()
    assert (error <= step[..., None] / 2 * (1 + 1e-5)).all()
    x = torch.randn(5, 256)
    bound = x.abs() @ (step.repeat_interleave(32, 1) / 2).T
    assert ((packed(x) - linear(x)).abs() <= bound * (1 + 1e-5) + 1e-6).all()
    bf16 = Int4Linear.quantize(linear.weight, linear.bias, 32, BF16)
    loose = bound * 1.05 + 2**-7 * (x.abs() @ linear.weight.abs().T) + 1e-3
    assert ((bf16(x) - linear(x)).abs() <= loose).all()


def test_packing_refuses_shapes_the_kernels_cannot_run():
    assert int4_fits(32, 64, 32) and int4_fits(48, 256, 128)
    assert not int4_fits(40, 64, 32)  # rows not a multiple of 16
    assert not int4_fits(32, 48, 32)  # columns not whole groups
    assert not int4_fits(32, 64, 16)  # a group size the kernel does not take
    with pytest.raises(ValueError, match="cannot pack a 40x64 weight"):
        Int4Linear.quantize(torch.randn(40, 64), None, 32, F32)
    # torch's bfloat16 int8 kernel crashes on widths that are not multiples of 16
    assert int8_fits(208) and not int8_fits(200)
    with pytest.raises(ValueError, match="int8 cannot run a weight of 200 columns"):
        Int8Linear.quantize(torch.randn(16, 200), None, BF16)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q4_K], ids=lambda t: t.name)
def test_gguf_4bit_blocks_are_the_kernels_weights_bit_for_bit(qtype):
    """The file's codes, scales and mins go to the kernel as they are: with float32 scales its
    weights are gguf-py's dequantization exactly (not merely close)."""
    rng = np.random.default_rng(1)
    array = rng.normal(0, 0.05, (48, 512)).astype(np.float32)
    array[:, 7] += 0.4  # blocks whose minimum is far from zero
    stored, decoded = encode(array, qtype, rng)
    codes, scales, zeros = int4_blocks(np.asarray(stored).reshape(48, -1), qtype)
    assert codes.min() >= 0 and codes.max() <= 15 and len(np.unique(codes)) == 16
    packed = Int4Linear.from_codes(*map(torch.from_numpy, (codes, scales, zeros)), None, 32)
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
        packed = int4_linear(tensor, None, heads, F32)
        assert torch.equal(packed.dequantized(), torch.from_numpy(expected)), name
    assert not keeps_blocks(tensors["token_embd.weight"])  # Q8_0: requantized, not kept


def test_quantization_is_checked_before_anything_loads():
    check_quantization("int4", torch.device("cpu"))
    with pytest.raises(ValueError, match="one of none, int8, int4, gguf, got 'int3'"):
        check_quantization("int3", torch.device("cpu"))
    for mode in ("int8", "int4", "gguf"):
        with pytest.raises(ValueError, match=f"{mode!r} runs torch's CPU kernels only"):
            check_quantization(mode, torch.device("cuda"))
    check_quantization("none", torch.device("cuda"))
