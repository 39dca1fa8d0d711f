"""GGUF mixture-of-experts files: their metadata as config fields, their stacked experts.

llama.cpp stores a layer's experts stacked, one tensor per projection
(`blk.N.ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`: [experts, rows,
columns]) beside the router (`ffn_gate_inp`), and says how many there are in
`{arch}.expert_count` / `expert_used_count`. Three architectures carry them
here: `qwen3moe` (Qwen3-MoE), `qwen2moe` (Qwen2-MoE, with a shared expert:
`ffn_*_shexp`, `ffn_gate_inp_shexp`) and `llama` with experts (Mixtral's files). Each
stacked tensor is split into one tensor per expert, a slice of the same
memory-mapped bytes (whole rows of blocks, never re-encoded), so every later
step (dequantization, the int4 kernel's repacking of Q4 blocks, the checks of
names and shapes) treats an expert's weight as any other weight.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
from gguf import ReaderTensor

from kvserve.model.checkpoint.errors import ModelLoadError

EXPERT_TENSORS = {
    "ffn_gate_exps": ("mlp.experts.{e}.gate_proj", "block_sparse_moe.experts.{e}.w1"),
    "ffn_up_exps": ("mlp.experts.{e}.up_proj", "block_sparse_moe.experts.{e}.w3"),
    "ffn_down_exps": ("mlp.experts.{e}.down_proj", "block_sparse_moe.experts.{e}.w2"),
    "ffn_gate_inp": ("mlp.gate", "block_sparse_moe.gate"),
}
"""llama.cpp's name -> the module under Qwen3-MoE's / OLMoE's names, then Mixtral's (the one
the model has is used); `{e}`: the expert."""
ROUTER = "ffn_gate_inp"
SHARED_EXPERT = {
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
"""Qwen2-MoE's shared expert and its gate: one tensor each (the gate one row, which
llama.cpp may store 1-D)."""
SPARSE_ARCHITECTURES = {"qwen2moe": False, "qwen3moe": True}
"""GGUF architectures of Qwen MoE models -> whether llama.cpp renormalises their top-k
weights when the file does not say (`expert_weights_norm`)."""
EXPERT_TENSOR = re.compile(
    rf"blk\.(\d+)\.({'|'.join([*EXPERT_TENSORS, *SHARED_EXPERT])})\.(weight)"
)


def gguf_moe_fields(
    arch: str, meta: Callable[[str, Any], Any], tensors: dict[str, Any], num_layers: int
) -> dict[str, Any]:
    """The config.json fields of a GGUF file's experts ({} for a dense file)."""
    experts = meta("expert_count", 0) or 0
    if not experts:
        if arch in SPARSE_ARCHITECTURES:
            raise ModelLoadError(f"GGUF {arch} file without {arch}.expert_count")
        return {}
    used = meta("expert_used_count", 0) or 0
    if not 0 < used <= experts:
        raise ModelLoadError(f"GGUF {arch}.expert_used_count {used!r} of {experts} experts")
    if arch == "llama":  # Mixtral: the top-k weights are always renormalised
        return {
            "architectures": ["MixtralForCausalLM"],
            "num_local_experts": experts,
            "num_experts_per_tok": used,
        }
    if arch not in SPARSE_ARCHITECTURES:
        raise ModelLoadError(f"GGUF {arch} files with experts are not supported")
    fields = {
        "num_experts": experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": _width(meta, arch, "expert_feed_forward_length"),
        "norm_topk_prob": bool(meta("expert_weights_norm", SPARSE_ARCHITECTURES[arch])),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [
            i for i in range(num_layers) if f"blk.{i}.{ROUTER}.weight" not in tensors
        ],
    }
    if arch == "qwen2moe":
        width = _width(meta, arch, "expert_shared_feed_forward_length")
        fields["shared_expert_intermediate_size"] = width
        fields["qkv_bias"] = "blk.0.attn_q.bias" in tensors
    return fields


def _width(meta: Callable[[str, Any], Any], arch: str, key: str) -> int:
    width = meta(key, None)
    if not isinstance(width, int) or width <= 0:
        raise ModelLoadError(f"GGUF metadata needs a positive integer {arch}.{key}")
    return width


def expert_tensors(
    tensor: ReaderTensor, expected: dict[str, Any]
) -> list[tuple[str, ReaderTensor]] | None:
    """A `blk.N.<key>.weight` expert tensor as (model name, tensor) pairs, one per expert (the
    router: one pair), or None when it is no expert tensor or the model has no such module."""
    match = EXPERT_TENSOR.fullmatch(tensor.name)
    if match is None:
        return None
    layer, key, kind = match.groups()
    if key in SHARED_EXPERT:
        name = f"model.layers.{layer}.{SHARED_EXPERT[key]}.{kind}"
        if name not in expected:
            return None
        if len(tensor.shape) == 1:  # the gate's one row, stored 1-D: [1, hidden]
            tensor = tensor._replace(shape=np.append(tensor.shape, 1), data=tensor.data[None])
        return [(name, tensor)]
    for template in EXPERT_TENSORS[key]:
        first = f"model.layers.{layer}.{template.format(e=0)}.{kind}"
        if first not in expected:
            continue
        if key == ROUTER:
            return [(first, tensor)]
        return [
            (f"model.layers.{layer}.{template.format(e=e)}.{kind}", expert_slice(tensor, e))
            for e in range(int(tensor.shape[-1]))
        ]
    return None


def expert_slice(tensor: ReaderTensor, expert: int) -> ReaderTensor:
    """One expert of a stacked [experts, rows, columns] tensor: a view of its bytes."""
    if len(tensor.shape) != 3:
        raise ModelLoadError(f"{tensor.name} must be 3-D (experts stacked), got {tensor.shape}")
    data = tensor.data[expert]
    return tensor._replace(
        name=f"{tensor.name}[{expert}]",
        shape=tensor.shape[:2].copy(),
        n_elements=int(tensor.n_elements) // int(tensor.shape[-1]),
        n_bytes=int(data.nbytes),
        data_offset=int(tensor.data_offset) + expert * int(data.nbytes),
        data=data,
    )
