"""The base model's projections, each row of a mixed batch with its own adapter.

A step's rows may belong to different adapters (and to none). The runner tells the
wrapped projections, once per step, which rows each resident adapter has
(`LoRABatch`); each projection then adds, per adapter present, the low-rank update
of those rows: two small matmuls per adapter and projection (a fused q/k/v one
included: its parts' lora_A stacked, their lora_B block-diagonal), gathered rows in
and added back (S-LoRA / Punica's segmented idea, with torch's own ops), never a loop
over requests. The arithmetic is PEFT's (`lora_B(lora_A(x)) * scaling`, added to the
base output; the other parts' terms are exact zeros), so greedy tokens match
`PeftModel`. Written here
because the field's multi-LoRA kernels (punica, S-LoRA) are CUDA-only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from kvserve.model.checkpoint.config import ModelConfig


@dataclass
class LoRABatch:
    """This step's rows per resident adapter: (slot, row indices or None for all rows)."""

    active: list[tuple[int, torch.Tensor | slice | None]] = field(default_factory=list)
    """Rows: None (every row), a slice (side by side: views, no copies) or indices."""


@dataclass
class _Update:
    """One adapter's update of a projection, its parts side by side: lora_A of every part
    it targets stacked (one matmul in), lora_B block-diagonal over the projection's
    output (one matmul out): the same products as part by part, the other parts' terms
    exact zeros."""

    lora_a: torch.Tensor
    """[sum of ranks, in]"""
    lora_b: torch.Tensor
    """[out, sum of ranks]"""
    scaling: float


class LoRAProjection(nn.Module):
    """A projection (maybe fused: q/k/v side by side) plus each resident adapter's update
    of its parts. `parts`: PEFT's module names in output order, with their widths."""

    def __init__(self, base: nn.Module, parts: list[tuple[str, int]], batch: LoRABatch) -> None:
        super().__init__()
        self.base = base
        self.batch = batch
        self.part_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, width in parts:
            self.part_offsets[name] = (offset, width)
            offset += width
        self.out_features = offset
        self._parts: dict[int, list[tuple[str, torch.Tensor, torch.Tensor, float]]] = {}
        self.updates: dict[int, _Update] = {}
        """slot -> its adapter's update (none where it leaves this projection alone)."""

    def set_update(
        self, slot: int, part: str, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float
    ) -> None:
        parts = self._parts.setdefault(slot, [])
        parts.append((part, lora_a, lora_b, scaling))
        ranks = sum(a.shape[0] for _, a, _, _ in parts)
        stacked_b = lora_b.new_zeros(self.out_features, ranks)
        column = 0
        for name, a, b, _ in parts:
            offset, width = self.part_offsets[name]
            stacked_b[offset : offset + width, column : column + a.shape[0]] = b
            column += a.shape[0]
        stacked_a = torch.cat([a for _, a, _, _ in parts]).contiguous()
        self.updates[slot] = _Update(stacked_a, stacked_b, scaling)

    def clear(self, slot: int) -> None:
        self._parts.pop(slot, None)
        self.updates.pop(slot, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        for slot, rows in self.batch.active:
            u = self.updates.get(slot)
            if u is None:
                continue
            if rows is None or isinstance(rows, slice):
                part = slice(None) if rows is None else rows
                delta = nn.functional.linear(nn.functional.linear(x[part], u.lora_a), u.lora_b)
                y[part] += delta.mul_(u.scaling)
                continue
            xs = x.index_select(0, rows)
            delta = nn.functional.linear(nn.functional.linear(xs, u.lora_a), u.lora_b)
            y.index_add_(0, rows, delta.mul_(u.scaling))
        return y


def attach_lora(
    model: nn.Module, config: ModelConfig, batch: LoRABatch
) -> dict[tuple[int, str], LoRAProjection]:
    """Wrap every projection an adapter may target, in every decoder layer; returns
    {(layer index, PEFT module name): its wrapper}. After fusion and quantization: the
    wrapper adds to whatever the base projection computes."""
    d = config.head_dim
    widths = {
        "q_proj": config.num_heads * d,
        "k_proj": config.num_kv_heads * d,
        "v_proj": config.num_kv_heads * d,
        "gate_proj": config.intermediate_size,
        "up_proj": config.intermediate_size,
    }
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    found: dict[tuple[int, str], LoRAProjection] = {}
    layers: nn.ModuleList = getattr(model.model, "layers")  # noqa: B009  # every decoder's
    for index, layer in enumerate(layers):
        for owner_name in ("self_attn", "mlp"):
            owner = getattr(layer, owner_name, None)
            if owner is None:
                continue
            for attr in ("qkv_proj", "gate_up_proj", "o_proj", "down_proj"):
                base = getattr(owner, attr, None)
                if not isinstance(base, nn.Module) or isinstance(base, LoRAProjection):
                    continue
                names = fused.get(attr, (attr,))
                out = _out_features(base)
                parts = [(n, widths[n]) for n in names] if attr in fused else [(attr, out)]
                if out < 0 or sum(w for _, w in parts) != out:
                    continue  # not the layout this wrapper assumes: left without adapters
                wrapper = LoRAProjection(base, parts, batch)
                if attr in fused:  # Phi-3 stores it fused and PEFT targets it so
                    wrapper.part_offsets[attr] = (0, out)
                setattr(owner, attr, wrapper)
                for name in (*names, attr) if attr in fused else names:
                    found[(index, name)] = wrapper
    return found


def _out_features(module: nn.Module) -> int:
    out = getattr(module, "out_features", None)
    if isinstance(out, int):
        return out
    weight = getattr(module, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) else -1
