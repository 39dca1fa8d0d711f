"""A GGUF file's 4-bit blocks as int4 kernel weights, without a round trip through float.

torch's CPU int4 kernel dequantizes code q (0..15) of a group of 32 columns
as (q - 8) * scale + zero. Three of llama.cpp's types are exactly that:

- Q4_0: w = d * (q - 8)                 -> scale d, zero 0
- Q4_1: w = d * q + m                   -> scale d, zero m + 8d
- Q4_K: w = (d * sc) * q - dmin * mn    -> per 32-column sub-block: scale d * sc,
        (6-bit sc, mn per sub-block)       zero 8 * d * sc - dmin * mn

With float32 scales the kernel's weights equal gguf-py's dequantization bit for
bit: (q - 8) * scale is exact (an fp16 times a small integer), so the one
rounding left is that of the sum, as in gguf-py's own float32 arithmetic
(tests/model/quant/test_quant_packing.py checks it on the default model's file). The
engine's kernels compute in bfloat16 (kvserve.model.quant.quantize), which rounds
scale and zero to bfloat16: the codes and groups stay the file's.

What does not map: Q8_0 (8-bit codes in blocks of 32, and the int8 kernel
has one scale per row), the 5-bit and 6-bit types, and Q2_K/Q3_K (groups of
16). Quantization 'gguf' requantizes those to per-channel int8 from their
dequantized values: as many levels as Q8_0 and more than the others, but one
scale per row instead of per block. Float tensors stay float.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import Q4_K

from kvserve.model.checkpoint.config import ModelConfig
from kvserve.model.checkpoint.gguf_weights import (
    dequantized,
    permuted_heads,
    tensor_shape,
    unpermute_rows,
)
from kvserve.model.quant.quant_linear import (
    Int4Linear,
    Int8Linear,
    PackedLinear,
    int4_fits,
    int8_fits,
)
from kvserve.model.quant.quantize import packing_targets

T = GGMLQuantizationType
GROUP = 32
INT4_TYPES = (T.Q4_0, T.Q4_1, T.Q4_K)
"""The GGUF types the int4 kernel runs as they are."""
FLOAT_TYPES = (T.F32, T.F16, T.BF16)


def int4_blocks(raw: np.ndarray, qtype: T) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes [N, K] int32, scales [N, K/32] float32, zeros [N, K/32] float32) of a
    tensor's blocks, `raw` being its bytes with one row per output row."""
    rows = raw.shape[0]
    if qtype == T.Q4_0:
        blocks = raw.reshape(rows, -1, 18)
        d = _fp16(blocks[..., 0:2])
        codes = _nibbles(blocks[..., 2:])
        scales, zeros = d, np.zeros_like(d)
    elif qtype == T.Q4_1:
        blocks = raw.reshape(rows, -1, 20)
        d, m = _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4])
        codes = _nibbles(blocks[..., 4:])
        scales, zeros = d, m + 8 * d
    elif qtype == T.Q4_K:
        blocks = raw.reshape(rows, -1, 144)
        d, dmin = _fp16(blocks[..., 0:2])[..., None], _fp16(blocks[..., 2:4])[..., None]
        sc, mn = Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))
        scales = d * sc.reshape(*blocks.shape[:2], 8).astype(np.float32)
        mins = dmin * mn.reshape(*blocks.shape[:2], 8).astype(np.float32)
        # 128 bytes = 4 runs of 32: low nibbles are sub-block 2j, high ones 2j + 1.
        qs = blocks[..., 16:].reshape(rows, -1, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]
        codes = (qs & 0x0F).reshape(rows, -1).astype(np.int32)
        scales, zeros = scales.reshape(rows, -1), (8 * scales - mins).reshape(rows, -1)
    else:
        raise ValueError(f"{qtype.name} blocks do not map onto the int4 kernel")
    return codes, scales.reshape(rows, -1), zeros.reshape(rows, -1)


def int4_linear(
    tensor: ReaderTensor,
    bias: torch.Tensor | None,
    heads: int | None,
    compute_dtype: torch.dtype,
) -> Int4Linear:
    """The packed layer of one GGUF weight; `heads`: undo llama.cpp's q/k row order first."""
    out_features, _ = tensor_shape(tensor)
    raw = np.asarray(tensor.data).reshape(out_features, -1)
    if heads is not None:
        raw = unpermute_rows(raw, heads)  # whole rows of blocks move, bytes untouched
    codes, scales, zeros = int4_blocks(raw, tensor.tensor_type)
    return Int4Linear.from_codes(
        torch.from_numpy(codes),
        torch.from_numpy(scales).to(compute_dtype),
        torch.from_numpy(zeros).to(compute_dtype),
        bias,
        GROUP,
    )


def keeps_blocks(tensor: ReaderTensor) -> bool:
    """Whether a weight's blocks go to the int4 kernel as they are."""
    if tensor.tensor_type not in INT4_TYPES or len(tensor.shape) != 2:
        return False
    out_features, in_features = tensor_shape(tensor)
    return int4_fits(out_features, in_features, GROUP)


def gguf_packed_layers(
    reader: GGUFReader,
    located: dict[str, ReaderTensor],
    model: torch.nn.Module,
    config: ModelConfig,
    compute_dtype: torch.dtype,
) -> dict[str, PackedLinear]:
    """The packed layers of quantization 'gguf', by module name: each weight at its file's
    precision.

    4-bit blocks that map go to the int4 kernel as they are; any other
    quantized type is requantized to per-channel int8 from its dequantized
    values; float tensors, and shapes neither kernel runs, stay float (no
    entry). A tied lm_head follows the embeddings' type. The model may be on
    the meta device: a bias stays the module's own parameter, for the loader
    to fill.
    """
    packed: dict[str, PackedLinear] = {}
    for name, (weight_name, bias) in packing_targets(model).items():
        tensor = located[weight_name]
        heads = permuted_heads(weight_name, config)
        if keeps_blocks(tensor):
            packed[name] = int4_linear(tensor, bias, heads, compute_dtype)
        elif tensor.tensor_type not in FLOAT_TYPES and int8_fits(tensor_shape(tensor)[1]):
            array = dequantized(tensor, reader)
            if heads is not None:
                array = unpermute_rows(array, heads)
            packed[name] = Int8Linear.quantize(torch.from_numpy(array), bias, compute_dtype)
    return packed


def _fp16(pairs: np.ndarray) -> np.ndarray:
    """float32 values of little-endian fp16 byte pairs (the last axis)."""
    return np.ascontiguousarray(pairs).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """A block's 32 codes from its 16 bytes: low nibbles first, then the high ones."""
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    return codes.reshape(qs.shape[0], -1).astype(np.int32)
