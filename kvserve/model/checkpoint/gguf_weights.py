"""A GGUF file's tensors as the model's parameters: names, dequantization, q/k rows.

Four things differ from a Hugging Face checkpoint, and each is undone here:

- names: llama.cpp's `blk.N.attn_q.weight` is transformers'
  `model.layers.N.self_attn.q_proj.weight` (kvserve uses transformers' names);
- types: quantized blocks are dequantized with gguf-py's reference numpy
  code (`gguf.quants.dequantize`), one tensor at a time, and converted to the
  engine's dtype: the only full copy of the weights is the model's own;
- Gemma's norm weights: the converter stores 1 + weight (llama.cpp's RMSNorm
  multiplies by the weight itself), kvserve's Gemma norms scale by 1 + weight;
- q/k rows of Llama-family models: transformers' rope rotates the two halves
  of a head (dim i with dim i + d/2), ggml's default rope rotates adjacent
  pairs (2i with 2i + 1), so llama.cpp's converter reorders the rows of q and
  k (and their biases) head by head to make one the other. kvserve rotates
  halves, so the rows go back. Qwen2 and Qwen3 run ggml's "neox" rope, which
  rotates halves already: their rows are stored as they are (so do Gemma 3 and
  Phi-3). Mistral files are Llama files, reordered alike.

Every name, shape and tensor type is checked before the first tensor is
dequantized, so a bad file fails before anything is built.
"""

from __future__ import annotations

import re

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

from kvserve.model.checkpoint.config import ModelConfig
from kvserve.model.checkpoint.errors import ModelLoadError
from kvserve.model.checkpoint.gguf_families import ROPE_FACTORS, WINDOWED_LLAMA
from kvserve.model.checkpoint.gguf_file import field
from kvserve.model.checkpoint.gguf_moe import expert_tensors
from kvserve.model.checkpoint.weight_check import check_weights

T = GGMLQuantizationType
SUPPORTED_TYPES = (
    T.F32,
    T.F16,
    T.BF16,
    T.Q8_0,
    T.Q4_0,
    T.Q4_1,
    T.Q5_0,
    T.Q5_1,
    T.Q2_K,
    T.Q3_K,
    T.Q4_K,
    T.Q5_K,
    T.Q6_K,
)
"""The float types and the legacy and K-quants: what llama.cpp's common files
(Q4_K_M, Q8_0, ...) are made of, each dequantized by gguf-py."""
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
"""`blk.N.<key>.weight|bias` -> `model.layers.N.<value>.weight|bias`."""
FAMILY_LAYER_NAMES = {
    "gemma3": {
        **LAYER_NAMES,
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "phi3": {**LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
"""Where a GGUF architecture's layer names differ: Gemma's four norms; Phi-3's fused
q/k/v and gate/up (its `ffn_up` holds the gate rows, then the up rows)."""
LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
NOT_WEIGHTS = ("rope_freqs.weight", *ROPE_FACTORS)
"""Tensors that describe the model rather than hold weights (read by gguf_config)."""
PERMUTED_ARCHITECTURES = ("LlamaForCausalLM", "MixtralForCausalLM", WINDOWED_LLAMA)
"""Architectures whose q/k rows llama.cpp's converter reorders for ggml's rope."""
NORM_PLUS_ONE_ARCHITECTURES = ("Gemma3ForCausalLM",)
"""Gemma scales by (1 + weight); llama.cpp's converter stores 1 + weight, which we undo."""


def model_name(gguf_name: str, gguf_arch: str = "llama") -> str | None:
    """kvserve's (transformers') name of a GGUF tensor, or None for a name it does not know."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    names = FAMILY_LAYER_NAMES.get(gguf_arch, LAYER_NAMES)
    match = LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in names:
        return None
    layer, key, kind = match.groups()
    return f"model.layers.{layer}.{names[key]}.{kind}"


def gguf_state_dict(
    reader: GGUFReader,
    located: dict[str, ReaderTensor],
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """The located tensors (`locate_tensors`) as parameters in `dtype` on `device`."""
    state: dict[str, torch.Tensor] = {}
    for name, tensor in located.items():
        array = dequantized(tensor, reader)
        heads = permuted_heads(name, config)
        if heads is not None:
            array = unpermute_rows(array, heads)
        if config.architecture in NORM_PLUS_ONE_ARCHITECTURES and name.endswith("norm.weight"):
            array = array - np.float32(1.0)
        state[name] = torch.from_numpy(array).to(device=device, dtype=dtype)
    return state


def locate_tensors(
    reader: GGUFReader, expected: dict[str, tuple[int, ...]]
) -> dict[str, ReaderTensor]:
    """Every expected parameter's tensor, after checking types, names and shapes."""
    located: dict[str, ReaderTensor] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    unexpected: list[str] = []
    gguf_arch = field(reader, "general.architecture")
    for tensor in reader.tensors:
        if tensor.name in NOT_WEIGHTS:
            continue
        experts = expert_tensors(tensor, expected)
        if experts is not None:  # a stacked tensor: one entry per expert
            located.update(experts)
            shapes.update((name, tensor_shape(part)) for name, part in experts)
            continue
        name = model_name(tensor.name, gguf_arch)
        if name is None or name not in expected:
            unexpected.append(tensor.name)
            continue
        if tensor.tensor_type not in SUPPORTED_TYPES:
            supported = ", ".join(t.name for t in SUPPORTED_TYPES)
            raise ModelLoadError(
                f"tensor {tensor.name} has type {tensor.tensor_type.name}, which kvserve cannot "
                f"dequantize; supported types: {supported}"
            )
        located[name] = tensor
        shapes[name] = tensor_shape(tensor)
    check_weights(expected, shapes, unexpected)
    return located


def tensor_shape(tensor: ReaderTensor) -> tuple[int, ...]:
    """The shape in torch's order: GGUF lists dimensions innermost first."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def dequantized(tensor: ReaderTensor, reader: GGUFReader) -> np.ndarray:
    """The tensor as a float32 array of its own (never a view of the memory-mapped file)."""
    array = dequantize(tensor.data, tensor.tensor_type).reshape(tensor_shape(tensor))
    if np.may_share_memory(array, reader.data):  # F32 comes back as a view of the file
        array = array.copy()
    return array


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: per head, row 2j + c goes back to row c * d/2 + j.

    The converter views each head's d rows as (2, d/2) and transposes them,
    interleaving the two halves; this views them as (d/2, 2) and transposes
    back. Works for weights (rows x columns) and biases (rows) alike.
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ModelLoadError(f"{rows} q/k rows do not split into {num_heads} heads of pairs")
    half = rows // num_heads // 2
    split = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return np.ascontiguousarray(split.swapaxes(1, 2)).reshape(weight.shape)


def permuted_heads(name: str, config: ModelConfig) -> int | None:
    """How many heads the rows of a reordered tensor form (None: not reordered)."""
    if config.architecture not in PERMUTED_ARCHITECTURES:
        return None
    if ".self_attn.q_proj." in name:
        return config.num_heads
    if ".self_attn.k_proj." in name:
        return config.num_kv_heads
    return None
