"""From a model's per-layer specs to KV cache groups that share one pool.

One pool hands out blocks of one size to every group. Layers with equal
specs form a kind; each kind is split into groups of the same number of
layers (the smallest kind's count, as vLLM does), so every group's page (one
block across its layers) has the same bytes, and the runner can keep one
tensor per position-in-group that every group's blocks index into.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvserve.kvcache.specs import KVCacheSpec, inflate_for_state


@dataclass(frozen=True, slots=True)
class GroupLayout:
    """Groups (each spec carries num_layers = group_size) and where each layer sits."""

    specs: list[KVCacheSpec]
    layer_group: list[int]
    """Per model layer: its group index."""
    layer_slot: list[int]
    """Per model layer: its position inside the group (the shared tensor it uses)."""
    group_size: int

    @property
    def page_bytes(self) -> int:
        return max(spec.page_bytes for spec in self.specs)


def group_layers(layer_specs: list[KVCacheSpec]) -> GroupLayout:
    """Group layers with equal specs into groups of equal size, in layer order.

    Each layer spec has num_layers=1. The last group of a kind may be short
    (its missing positions are simply unused).
    """
    if not layer_specs:
        raise ValueError("a model needs at least one layer with a KV cache")
    kinds: dict[KVCacheSpec, list[int]] = {}
    for layer, spec in enumerate(layer_specs):
        if spec.num_layers != 1:
            raise ValueError(f"layer {layer}: per-layer specs have num_layers=1")
        kinds.setdefault(spec, []).append(layer)
    size = min(len(layers) for layers in kinds.values())
    specs: list[KVCacheSpec] = []
    layer_group = [0] * len(layer_specs)
    layer_slot = [0] * len(layer_specs)
    for spec, layers in kinds.items():
        for start in range(0, len(layers), size):
            group = len(specs)
            specs.append(replace(spec, num_layers=size))
            for slot, layer in enumerate(layers[start : start + size]):
                layer_group[layer] = group
                layer_slot[layer] = slot
    return GroupLayout(inflate_for_state(specs), layer_group, layer_slot, size)
