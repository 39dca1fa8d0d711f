"""The projections of a loaded model an adapter may target, wrapped, under PEFT's names.

PEFT names a LoRA weight by its module's path in the transformers model. kvserve's
model keeps those paths, except that it fuses projections (q/k/v, gate/up: each
part's name maps to its rows of the fused one; Phi-3 stores them fused and PEFT
names the whole). Experts: each is a module of its own here. Adapters saved with
transformers 4 name them one by one (`mlp.experts.3.gate_proj`,
`block_sparse_moe.experts.3.w1`); transformers 5 stores an MoE's experts as fused
3-D weights, which PEFT adapts through `target_parameters` (`mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`) with one LoRA per expert stacked along the rank; those
resolve to every expert's projection of the layer (kvserve.lora.weights splits
them). Qwen2-MoE's shared expert is a plain MLP (`mlp.shared_expert.gate_proj`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvserve.lora.layers import LoRABatch, LoRAProjection
from kvserve.model.checkpoint.config import ModelConfig

_ATTRS = ("qkv_proj", "gate_up_proj", "o_proj", "down_proj", "w2")
"""The projections an owner (attention, MLP, expert) may have, under kvserve's names."""
EXPERT_PARAMETERS = {"gate_up_proj": ("gate_up_proj",), "down_proj": ("down_proj", "w2")}
"""transformers 5's fused expert weights -> the projection of each expert they are."""


@dataclass
class LoRATargets:
    projections: dict[tuple[int, str], LoRAProjection]
    """(layer, PEFT's path in the layer: self_attn.q_proj, mlp.down_proj,
    mlp.shared_expert.up_proj, mlp.experts.3.gate_proj) -> its wrapper."""
    expert_parameters: dict[tuple[int, str], list[LoRAProjection]]
    """(layer, gate_up_proj | down_proj) -> each expert's wrapper of it, by expert id."""


def attach_lora(model: nn.Module, config: ModelConfig, batch: LoRABatch) -> LoRATargets:
    """Wrap every projection an adapter may target, in every decoder layer. After fusion
    and quantization: the wrapper adds to whatever the base projection computes."""
    targets = LoRATargets({}, {})
    layers: nn.ModuleList = getattr(model.model, "layers")  # noqa: B009  # every decoder's
    for index, layer in enumerate(layers):
        _wrap(getattr(layer, "self_attn", None), "self_attn", index, config, batch, targets)
        name = getattr(layer, "block_name", "mlp")  # the MoE decoder's feed-forward
        block = getattr(layer, name, None)
        experts = getattr(block, "experts", None)
        if not isinstance(experts, nn.ModuleList):
            _wrap(block, name, index, config, batch, targets)
            continue
        setattr(block, "on_expert_rows", batch.set_expert_rows)  # noqa: B010  # the dispatch's hook
        shared = getattr(block, "shared_expert", None)
        _wrap(shared, f"{name}.shared_expert", index, config, batch, targets)
        for number, expert in enumerate(experts):
            path = f"{name}.experts.{number}"
            wrapped = _wrap(expert, path, index, config, batch, targets, expert=True)
            for parameter, attrs in EXPERT_PARAMETERS.items():
                found = [wrapped[a] for a in attrs if a in wrapped]
                if found:
                    found[0].part_offsets.setdefault(parameter, (0, found[0].out_features))
                    targets.expert_parameters.setdefault((index, parameter), []).append(found[0])
        for parameter in EXPERT_PARAMETERS:
            if len(targets.expert_parameters.get((index, parameter), ())) != len(experts):
                targets.expert_parameters.pop((index, parameter), None)  # not every expert's
    return targets


def _wrap(
    owner: nn.Module | None,
    path: str,
    index: int,
    config: ModelConfig,
    batch: LoRABatch,
    targets: LoRATargets,
    expert: bool = False,
) -> dict[str, LoRAProjection]:
    """Wrap `owner`'s projections; {kvserve's attribute: its wrapper}."""
    wrapped: dict[str, LoRAProjection] = {}
    if owner is None:
        return wrapped
    fused: dict[str, tuple[str, ...]] = getattr(type(owner), "FUSED_PROJECTIONS", {})
    for attr in _ATTRS:
        base = getattr(owner, attr, None)
        if not isinstance(base, nn.Module) or isinstance(base, LoRAProjection):
            continue
        out = _out_features(base)
        names = fused.get(attr, ())
        parts = [(attr, out)] if not names else _fused_widths(attr, names, out, config)
        if out < 0 or sum(w for _, w in parts) != out:
            continue  # not the layout this wrapper assumes: left without adapters
        wrapper = LoRAProjection(base, parts, batch, expert=expert)
        wrapper.part_offsets.setdefault(attr, (0, out))  # the whole, as PEFT names a fused one
        setattr(owner, attr, wrapper)
        wrapped[attr] = wrapper
        for name in (*names, attr):
            targets.projections[(index, f"{path}.{name}")] = wrapper
    return wrapped


def _fused_widths(
    attr: str, names: tuple[str, ...], out: int, config: ModelConfig
) -> list[tuple[str, int]]:
    if attr == "qkv_proj":
        d = config.head_dim
        return list(zip(names, (config.num_heads * d, config.num_kv_heads * d,
                                config.num_kv_heads * d), strict=True))  # fmt: skip
    return [(name, out // len(names)) for name in names]  # gate and up: equal halves


def _out_features(module: nn.Module) -> int:
    out = getattr(module, "out_features", None)
    if isinstance(out, int):
        return out
    weight = getattr(module, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) else -1
