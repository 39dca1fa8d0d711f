"""A GGUF file's 4-bit blocks as int4 kernel weights, without a round trip through float.

The int4 kernel reads code q (0..15) of a block of 32 columns as
q * scale + offset. Three of llama.cpp's types are exactly that:

- Q4_0: w = d * (q - 8)                 -> scale d, offset -8d (none stored)
- Q4_1: w = d * q + m                   -> scale d, offset m
- Q4_K: w = (d * sc) * q - dmin * mn    -> per 32-column sub-block: scale d * sc,
        (6-bit sc, mn per sub-block)       offset -dmin * mn

The scales and offsets stay float16 where that holds them exactly (Q4_0, Q4_1:
the file's own bytes, 18 or 20 per 32 weights) and float32 otherwise (Q4_K's
products). The kernel's weights then equal gguf-py's dequantization bit for bit:
q * scale is exact (an fp16 times a small integer), so the one rounding left is
that of the sum, as in gguf-py's own float32 arithmetic
(tests/model/quant/test_quant_packing.py checks it on the default model's file).

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
from kvserve.model.quant.quant_linear import Int4Linear, Int8Linear, PackedLinear, fits
from kvserve.model.quant.quantize import packing_targets

T = GGMLQuantizationType
INT4_TYPES = (T.Q4_0, T.Q4_1, T.Q4_K)
"""The GGUF types the int4 kernel runs as they are."""
FLOAT_TYPES = (T.F32, T.F16, T.BF16)


def int4_blocks(raw: np.ndarray, qtype: T) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes [N, K] int32, scales [N, K/32] float32, offsets [N, K/32] float32) of a
    tensor's blocks, `raw` being its bytes with one row per output row."""
    rows = raw.shape[0]
    if qtype == T.Q4_0:
        blocks = raw.reshape(rows, -1, 18)
        d = _fp16(blocks[..., 0:2])
        codes = _nibbles(blocks[..., 2:])
        scales, offsets = d, -8 * d
    elif qtype == T.Q4_1:
        blocks = raw.reshape(rows, -1, 20)
        d, m = _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4])
        codes = _nibbles(blocks[..., 4:])
        scales, offsets = d, m
    elif qtype == T.Q4_K:
        blocks = raw.reshape(rows, -1, 144)
        d, dmin = _fp16(blocks[..., 0:2])[..., None], _fp16(blocks[..., 2:4])[..., None]
        sc, mn = Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))
        scales = d * sc.reshape(*blocks.shape[:2], 8).astype(np.float32)
        mins = dmin * mn.reshape(*blocks.shape[:2], 8).astype(np.float32)
        # 128 bytes = 4 runs of 32: low nibbles are sub-block 2j, high ones 2j + 1.
        qs = blocks[..., 16:].reshape(rows, -1, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]
        codes = (qs & 0x0F).reshape(rows, -1).astype(np.int32)
        scales, offsets = scales.reshape(rows, -1), -mins.reshape(rows, -1)
    else:
        raise ValueError(f"{qtype.name} blocks do not map onto the int4 kernel")
    return codes, scales.reshape(rows, -1), offsets.reshape(rows, -1)


def int4_linear(tensor: ReaderTensor, bias: torch.Tensor | None, heads: int | None) -> Int4Linear:
    """The packed layer of one GGUF weight; `heads`: undo llama.cpp's q/k row order first."""
    out_features, _ = tensor_shape(tensor)
    raw = np.asarray(tensor.data).reshape(out_features, -1)
    if heads is not None:
        raw = unpermute_rows(raw, heads)  # whole rows of blocks move, bytes untouched
    codes, scales, offsets = int4_blocks(raw, tensor.tensor_type)
    exact_in_fp16 = all(
        np.array_equal(a.astype(np.float16).astype(np.float32), a) for a in (scales, offsets)
    )
    dtype = np.float16 if exact_in_fp16 else np.float32
    symmetric = np.array_equal(offsets, -8 * scales)  # Q4_0: no offsets stored
    return Int4Linear.from_codes(
        torch.from_numpy(codes),
        torch.from_numpy(scales.astype(dtype)),
        None if symmetric else torch.from_numpy(offsets.astype(dtype)),
        bias,
    )


def keeps_blocks(tensor: ReaderTensor) -> bool:
    """Whether a weight's blocks go to the int4 kernel as they are."""
    if tensor.tensor_type not in INT4_TYPES or len(tensor.shape) != 2:
        return False
    return fits(tensor_shape(tensor)[1])


def gguf_packed_layers(
    reader: GGUFReader,
    located: dict[str, ReaderTensor],
    model: torch.nn.Module,
    config: ModelConfig,
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
            packed[name] = int4_linear(tensor, bias, heads)
        elif tensor.tensor_type not in FLOAT_TYPES and fits(tensor_shape(tensor)[1]):
            array = dequantized(tensor, reader)
            if heads is not None:
                array = unpermute_rows(array, heads)
            packed[name] = Int8Linear.quantize(torch.from_numpy(array), bias)
    return packed


def _fp16(pairs: np.ndarray) -> np.ndarray:
    """float32 values of little-endian fp16 byte pairs (the last axis)."""
    return np.ascontiguousarray(pairs).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """A block's 32 codes from its 16 bytes: low nibbles first, then the high ones."""
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    return codes.reshape(qs.shape[0], -1).astype(np.int32)
