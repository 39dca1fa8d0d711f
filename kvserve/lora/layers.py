"""The base model's projections, each row of a mixed batch with its own adapter.

A step's rows may belong to different adapters (and to none). The runner tells the
wrapped projections, once per step, which rows each resident adapter has
(`LoRABatch`); each projection then adds, per adapter present, the low-rank update
of those rows: two small matmuls per adapter and projection (a fused q/k/v one
included: its parts' lora_A stacked, their lora_B block-diagonal), gathered rows in
and added back (S-LoRA / Punica's segmented idea, with torch's own ops), never a loop
over requests. The arithmetic is PEFT's (`lora_B(lora_A(x)) * scaling`, added to the
base output; the other parts' terms are exact zeros), so greedy tokens match
`PeftModel`. An expert sees some of the step's rows, grouped by the MoE dispatch,
which names them (`LoRABatch.expert_rows`); its wrapper picks each adapter's among
them by the rows' slots. Written here because the field's multi-LoRA kernels
(punica, S-LoRA) are CUDA-only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class LoRABatch:
    """This step's rows per resident adapter: (slot, row indices or None for all rows)."""

    active: list[tuple[int, torch.Tensor | slice | None]] = field(default_factory=list)
    """Rows: None (every row), a slice (side by side: views, no copies) or indices."""
    row_slots: torch.Tensor | None = None
    """[rows]: each row's slot, -1 for the base model; set when experts are adapted (an
    expert sees some rows of the step, in its own order)."""
    expert_rows: torch.Tensor | None = None
    """The step's rows the expert running now sees, in its input's order (set by the
    mixture-of-experts dispatch, kvserve.model.layers.moe.run_experts)."""

    def set_expert_rows(self, rows: torch.Tensor) -> None:
        self.expert_rows = rows


@dataclass
class _Update:
    """One adapter's update of a projection, its parts side by side: lora_A of every part
    it targets stacked (one matmul in), lora_B block-diagonal over the projection's
    output (one matmul out): the same products as part by part, the other parts' terms
    exact zeros."""

    lora_a: torch.Tensor
    """[sum of ranks, in]"""
    lora_b: torch.Tensor
    """[out, sum of ranks]; each part's columns times its scaling where parts differ."""
    scaling: float


class LoRAProjection(nn.Module):
    """A projection (maybe fused: q/k/v side by side) plus each resident adapter's update
    of its parts. `parts`: PEFT's module names in output order, with their widths.
    `expert`: an expert's projection, which sees the rows `batch.expert_rows` names."""

    def __init__(
        self,
        base: nn.Module,
        parts: list[tuple[str, int]],
        batch: LoRABatch,
        expert: bool = False,
    ) -> None:
        super().__init__()
        self.base = base
        self.batch = batch
        self.expert = expert
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
        one = len({s for _, _, _, s in parts}) == 1  # PEFT's order: (B @ A x) * scaling
        stacked_b = lora_b.new_zeros(self.out_features, ranks)
        column = 0
        for name, a, b, s in parts:
            offset, width = self.part_offsets[name]
            block = b if one else b * s
            stacked_b[offset : offset + width, column : column + a.shape[0]] = block
            column += a.shape[0]
        stacked_a = torch.cat([a for _, a, _, _ in parts]).contiguous()
        self.updates[slot] = _Update(stacked_a, stacked_b, scaling if one else 1.0)

    def clear(self, slot: int) -> None:
        self._parts.pop(slot, None)
        self.updates.pop(slot, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.expert:
            return self._expert_rows(x, y)
        for slot, rows in self.batch.active:
            u = self.updates.get(slot)
            if u is None:
                continue
            if rows is None or isinstance(rows, slice):
                part = slice(None) if rows is None else rows
                y[part] += _delta(x[part], u, y.dtype)
                continue
            y.index_add_(0, rows, _delta(x.index_select(0, rows), u, y.dtype))
        return y

    def _expert_rows(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """An expert's rows are some of the step's, grouped by the dispatch: each adapter's
        among them by its slot (one comparison and gather per adapter in the step)."""
        batch = self.batch
        if not self.updates or batch.row_slots is None or batch.expert_rows is None:
            return y
        slots = batch.row_slots.index_select(0, batch.expert_rows)
        for slot, rows in batch.active:
            u = self.updates.get(slot)
            if u is None:
                continue
            if rows is None:  # every row of the step is this adapter's
                y += _delta(x, u, y.dtype)
                continue
            mine = (slots == slot).nonzero().squeeze(1)
            if mine.numel():
                y.index_add_(0, mine, _delta(x.index_select(0, mine), u, y.dtype))
        return y


def _delta(x: torch.Tensor, u: _Update, dtype: torch.dtype) -> torch.Tensor:
    """PEFT's `lora_B(lora_A(x)) * scaling`, in the adapter's dtype (float32 on the CPU
    for a 16-bit model: kvserve.lora.slots.compute_dtype), returned in `dtype`."""
    if x.dtype != u.lora_a.dtype:
        x = x.to(u.lora_a.dtype)
    delta = nn.functional.linear(nn.functional.linear(x, u.lora_a), u.lora_b).mul_(u.scaling)
    return delta if delta.dtype == dtype else delta.to(dtype)
