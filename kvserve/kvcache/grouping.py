"""From per-layer specs to KV cache groups that share one pool.

One pool hands out blocks of one size to every group. Layers with equal
specs form a kind; each kind is split into groups of the same number of
layers (the smallest kind's count, as vLLM does), so every group's page (one
block across its layers) has the same bytes, and the runner can keep one
tensor per position-in-group that every group's blocks index into.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvserve.kvcache.specs import (
    FullAttentionSpec,
    KVCacheSpec,
    MambaStateSpec,
    SlidingWindowSpec,
)


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


def inflate_for_state(specs: list[KVCacheSpec]) -> list[KVCacheSpec]:
    """One page size for attention and state groups: grow the attention block.

    A state page (a whole request's recurrent state) is usually far larger
    than one hash block of K/V, so attention blocks become k hash blocks,
    the smallest k whose page holds a state page (vLLM does the same). The
    hash block size, the unit of matching and events, is unchanged; state
    groups take the physical block size as their snapshot interval.
    """
    if not any(isinstance(s, MambaStateSpec) for s in specs):
        return specs
    if any(isinstance(s, SlidingWindowSpec) for s in specs):
        raise ValueError("sliding-window layers together with Mamba state layers are not supported")
    attention = [s for s in specs if isinstance(s, FullAttentionSpec)]
    if not attention:
        raise ValueError(
            "Mamba state layers need at least one full-attention layer: prefix hits are "
            "verified against the attention blocks (pure Mamba models are not supported)"
        )
    hash_block_size = attention[0].block_size
    if any(s.block_size != hash_block_size for s in specs):
        raise ValueError("every layer spec must start from the same (hash) block size")
    state_page = max(s.page_bytes for s in specs if isinstance(s, MambaStateSpec))
    per_hash_block = max(s.page_bytes for s in attention)
    k = max(1, -(-state_page // per_hash_block))
    return [replace(s, block_size=k * hash_block_size) for s in specs]
