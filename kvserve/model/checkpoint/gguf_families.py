"""What a GGUF file of one family keeps beyond the shared fields, as config.json fields.

llama.cpp's converter writes each family's own hyperparameters under its own keys,
and leaves out what llama.cpp hard-codes for the family; both are read back here
so that ModelConfig.from_dict sees what the Hugging Face config.json would hold:

- llama: Mistral files are llama files (same tensors, same q/k row order); one
  that carries `llama.attention.sliding_window` (and no experts) runs as Mistral
  with that window on every layer, one without as Llama (what the converter
  writes for Mistral checkpoints whose window is null);
- gemma3: the window (`attention.sliding_window`) and which layers use it (every
  sixth layer global, as llama.cpp sets it, unless the file lists them in
  `attention.sliding_window_pattern`); sliding layers' rope base 10000 and the
  query scale 1/sqrt(head_dim) (1/sqrt(hidden / heads) for the 62-layer 27B),
  both hard-coded in llama.cpp; the final soft-cap if the file has one;
- phi3: the rotated dims (`rope.dimension_count`, partial rotary), the original
  context, the window, and longrope's factors, which the converter writes as the
  tensors `rope_factors_short` / `rope_factors_long` (its attention factor as
  `rope.scaling.attn_factor`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from gguf import ReaderTensor
from gguf.quants import dequantize

from kvserve.model.checkpoint.errors import ModelLoadError

WINDOWED_LLAMA = "MistralForCausalLM"
GEMMA3_GLOBAL_EVERY = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_27B_LAYERS = 62
ROPE_FACTORS = ("rope_factors_short.weight", "rope_factors_long.weight")
"""Phi-3's longrope factors: tensors that describe the model rather than hold weights."""

Meta = Callable[..., Any]


def family_fields(
    arch: str, meta: Meta, tensors: dict[str, ReaderTensor], shape: dict[str, Any]
) -> dict[str, Any]:
    """The config.json fields of family `arch` (`meta(key)` reads `{arch}.key`; `shape`:
    hidden_size, num_attention_heads, head_dim, num_hidden_layers)."""
    head_dim = shape["head_dim"]
    rotary = meta("rope.dimension_count") or head_dim
    if rotary != head_dim and arch != "phi3":
        raise ModelLoadError(
            f"partial rotary embedding (rope.dimension_count {rotary} of head dim {head_dim}) "
            f"is not supported for GGUF architecture {arch!r}"
        )
    if arch == "llama":
        window = meta("attention.sliding_window")
        if not window:
            return {}
        if meta("expert_count"):  # a mixture of experts: its own reader judges the window
            return {"sliding_window": window}
        return {"architectures": [WINDOWED_LLAMA], "sliding_window": window}
    if arch == "gemma3":
        return _gemma3(meta, shape)
    if arch == "phi3":
        return _phi3(meta, tensors, rotary, head_dim)
    return {}


def _gemma3(meta: Meta, shape: dict[str, Any]) -> dict[str, Any]:
    layers = shape["num_hidden_layers"]
    window = meta("attention.sliding_window")
    pattern = meta("attention.sliding_window_pattern")
    if isinstance(pattern, list):  # one flag per layer: true slides
        types = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        every = int(pattern or GEMMA3_GLOBAL_EVERY)
        types = [
            "full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers)
        ]
    if not window:
        types = ["full_attention"] * layers
    scalar = shape["head_dim"]
    if layers == GEMMA3_27B_LAYERS:
        scalar = shape["hidden_size"] // shape["num_attention_heads"]
    return {
        "layer_types": types,
        "sliding_window": window,
        "query_pre_attn_scalar": scalar,
        "rope_local_base_freq": GEMMA3_LOCAL_ROPE_BASE,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": meta("final_logit_softcapping"),
    }


def _phi3(
    meta: Meta, tensors: dict[str, ReaderTensor], rotary: int, head_dim: int
) -> dict[str, Any]:
    fields: dict[str, Any] = {"partial_rotary_factor": rotary / head_dim}
    window = meta("attention.sliding_window")
    if window:
        fields["sliding_window"] = window
    original = meta("rope.scaling.original_context_length")
    if original is not None:
        fields["original_max_position_embeddings"] = int(original)
    present = [name for name in ROPE_FACTORS if name in tensors]
    if not present:
        return fields
    if len(present) != len(ROPE_FACTORS):
        raise ModelLoadError(f"GGUF phi3 file has {present[0]} without its pair {ROPE_FACTORS}")
    short, long = (_values(tensors[name]) for name in ROPE_FACTORS)
    scaling: dict[str, Any] = {"rope_type": "longrope", "short_factor": short, "long_factor": long}
    attn_factor = meta("rope.scaling.attn_factor")
    if attn_factor is not None:
        scaling["attention_factor"] = float(attn_factor)
    fields["rope_scaling"] = scaling
    return fields


def _values(tensor: ReaderTensor) -> list[float]:
    array = dequantize(tensor.data, tensor.tensor_type).astype(np.float64).reshape(-1)
    return [float(v) for v in array]
