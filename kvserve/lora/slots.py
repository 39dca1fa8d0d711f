"""Which adapters are resident, which stay loaded on the host, and the step's rows.

`max_loras` slots hold an adapter's updates in the wrapped projections; the
scheduler never runs more distinct adapters in a step than that, so a step's
adapters always fit, and an adapter not in the step is the one a newcomer
replaces (least recently used). Up to `max_cpu_loras` adapters stay read and
converted, so one evicted from a slot comes back without reading its files again.
Keyed by the adapter's content identity: a name reloaded with other weights is
another adapter.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from kvserve.batch import SeqChunk
from kvserve.lora.layers import LoRABatch
from kvserve.lora.request import Adapter
from kvserve.lora.targets import attach_lora
from kvserve.lora.weights import LoadedAdapter, load_adapter_weights
from kvserve.model.checkpoint.config import ModelConfig

log = logging.getLogger("kvserve.lora")


def compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The adapters' dtype: the model's, but float32 on the CPU for a 16-bit model, where
    torch's bfloat16 matmuls with a rank-sized side cost more than float32's (a decode
    profile of 4 adapters on the default model: about a tenth less CPU time in all) and
    the update is computed more exactly; it is cast to the model's dtype when added."""
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return dtype


class LoRASlots:
    """The runner's adapters: the wrapped projections, the slots, the host copies."""

    def __init__(
        self,
        model: nn.Module,
        config: ModelConfig,
        max_loras: int,
        max_cpu_loras: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.batch = LoRABatch()
        self.targets = attach_lora(model, config, self.batch)
        self.projections = self.targets.projections
        self._wrappers = list({id(p): p for p in self.projections.values()}.values())
        self._experts = any(p.expert for p in self._wrappers)
        if not self.projections:
            raise ValueError(f"LoRA: no projection of {config.architecture} can be adapted")
        self.max_loras = max_loras
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self.device = device
        self.dtype = compute_dtype(dtype, device)
        self._resident: OrderedDict[str, int] = OrderedDict()
        """identity -> slot, least recently used first."""
        self._loaded: OrderedDict[str, LoadedAdapter] = OrderedDict()
        """identity -> its weights read and converted, up to max_cpu_loras (and every
        resident one)."""

    @classmethod
    def for_runner(cls, runner: Any, max_loras: int, max_cpu_loras: int) -> LoRASlots | None:
        """The slots over a model runner's loaded model; None when `max_loras` is 0."""
        if not max_loras:
            return None
        return cls(
            runner.model, runner.config, max_loras, max_cpu_loras, runner.dtype, runner.device
        )

    def load(self, adapter: Adapter) -> None:
        """Read and check an adapter (a ValueError names what is wrong), and keep it read."""
        self._weights(adapter)

    def prepare(self, chunks: Sequence[SeqChunk]) -> None:
        """Tell the projections this step's rows per adapter (before the forward)."""
        rows: dict[str, list[int]] = {}
        adapters: dict[str, Adapter] = {}
        start = 0
        for chunk in chunks:
            width = chunk.plan.num_tokens
            if chunk.lora is not None:
                key = chunk.lora.identity
                adapters[key] = chunk.lora
                rows.setdefault(key, []).extend(range(start, start + width))
            start += width
        active: list[tuple[int, torch.Tensor | slice | None]] = []
        in_step = set(adapters)
        for key, adapter in adapters.items():
            slot = self._slot(adapter, in_step)
            mine = rows[key]
            if len(mine) == start:
                active.append((slot, None))  # every row
            elif mine[-1] - mine[0] + 1 == len(mine):  # side by side (the scheduler sorts)
                active.append((slot, slice(mine[0], mine[-1] + 1)))
            else:
                active.append((slot, torch.tensor(mine, dtype=torch.long, device=self.device)))
        self.batch.active = active
        self.batch.row_slots = None
        if self._experts and active:  # an expert sees some rows, in its own order
            row_slots = torch.full((start,), -1, dtype=torch.long, device=self.device)
            for slot, these in active:
                row_slots[slice(None) if these is None else these] = slot
            self.batch.row_slots = row_slots

    def _slot(self, adapter: Adapter, in_step: set[str]) -> int:
        key = adapter.identity
        if key in self._resident:
            self._resident.move_to_end(key)
            return self._resident[key]
        taken = set(self._resident.values())
        free = [s for s in range(self.max_loras) if s not in taken]
        if free:
            slot = free[0]
        else:
            victim = next((k for k in self._resident if k not in in_step), None)
            if victim is None:  # the scheduler admits at most max_loras adapters
                raise RuntimeError(f"a step with more than max_loras ({self.max_loras}) adapters")
            slot = self._resident.pop(victim)
        for projection in self._wrappers:
            projection.clear(slot)
        for u in self._weights(adapter):
            u.projection.set_update(slot, u.part, u.lora_a, u.lora_b, u.scaling)
        self._resident[key] = slot
        log.info("LoRA adapter %s (%s) in slot %d", adapter.name, adapter.identity[:24], slot)
        return slot

    def _weights(self, adapter: Adapter) -> LoadedAdapter:
        key = adapter.identity
        if key in self._loaded:
            self._loaded.move_to_end(key)
            return self._loaded[key]
        weights = load_adapter_weights(adapter, self.targets, self.dtype, self.device)
        self._loaded[key] = weights
        while len(self._loaded) > self.max_cpu_loras:
            old = next(iter(self._loaded))
            if old in self._resident:
                break  # a resident adapter's weights are in use
            del self._loaded[old]
        return weights
