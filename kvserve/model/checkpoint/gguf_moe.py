"""GGUF mixture-of-experts files: their metadata as config fields, their stacked experts.

llama.cpp stores a layer's experts stacked, one tensor per projection
(`blk.N.ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`: [experts, rows,
columns]) beside the router (`ffn_gate_inp`), and says how many there are in
`{arch}.expert_count` / `expert_used_count`. Two architectures carry them
here: `qwen3moe` (Qwen3-MoE) and `llama` with experts (Mixtral's files). Each
stacked tensor is split into one tensor per expert, a slice of the same
memory-mapped bytes (whole rows of blocks, never re-encoded), so every later
step (dequantization, the int4 kernel's repacking of Q4 blocks, the checks of
names and shapes) treats an expert's weight as any other weight.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

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
EXPERT_TENSOR = re.compile(rf"blk\.(\d+)\.({'|'.join(EXPERT_TENSORS)})\.(weight)")


def gguf_moe_fields(
    arch: str, meta: Callable[[str, Any], Any], tensors: dict[str, Any], num_layers: int
) -> dict[str, Any]:
    """The config.json fields of a GGUF file's experts ({} for a dense file)."""
    experts = meta("expert_count", 0) or 0
    if not experts:
        if arch == "qwen3moe":
            raise ModelLoadError("GGUF qwen3moe file without qwen3moe.expert_count")
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
    if arch != "qwen3moe":
        raise ModelLoadError(f"GGUF {arch} files with experts are not supported")
    width = meta("expert_feed_forward_length", None)
    if not isinstance(width, int) or width <= 0:
        raise ModelLoadError(f"GGUF metadata needs {arch}.expert_feed_forward_length")
    return {
        "num_experts": experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": width,
        # llama.cpp renormalises qwen3moe's top-k weights unless the file says otherwise
        "norm_topk_prob": bool(meta("expert_weights_norm", True)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [
            i for i in range(num_layers) if f"blk.{i}.{ROUTER}.weight" not in tensors
        ],
    }


def expert_tensors(
    tensor: ReaderTensor, expected: dict[str, Any]
) -> list[tuple[str, ReaderTensor]] | None:
    """A `blk.N.<key>.weight` expert tensor as (model name, tensor) pairs, one per expert (the
    router: one pair), or None when it is no expert tensor or the model has no such module."""
    match = EXPERT_TENSOR.fullmatch(tensor.name)
    if match is None:
        return None
    layer, key, kind = match.groups()
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
