"""An adapter's PEFT weights read into updates of the wrapped projections, checked.

PEFT saves `base_model.model.<the module's path>.lora_A.weight` ([rank, in]) and
`...lora_B.weight` ([out, rank]). Every key must name a projection the base model
has and kvserve wraps (kvserve.lora.targets), with the base's widths: a mismatch is
one line naming the key, the shape and what the base expects.

The experts' fused 3-D weights (transformers 5, `target_parameters`) hold one LoRA
per expert: lora_A [rank * experts, in], expert e's rows e*rank..(e+1)*rank, and
lora_B [out, rank * experts], expert e's columns e, e + experts, ... (PEFT's
`ParamWrapper.get_delta_weight`). Both weights of one module are nested wrappers:
the one registered first (gate_up_proj) is the inner, its keys `experts.base_layer.`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from safetensors.torch import load_file

from kvserve.lora.layers import LoRAProjection
from kvserve.lora.request import WEIGHTS_FILE, Adapter
from kvserve.lora.targets import EXPERT_PARAMETERS, LoRATargets

_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.([\w.]+?)\.lora_([AB])(?:\.\w+)?\.weight$"
)
_FUSED_EXPERTS = re.compile(r"^(\w+\.experts)((?:\.base_layer)*)$")


@dataclass(frozen=True)
class Update:
    """One part of one projection, for one adapter."""

    projection: LoRAProjection
    part: str
    lora_a: torch.Tensor
    """[rank, in]"""
    lora_b: torch.Tensor
    """[part's width, rank]"""
    scaling: float


LoadedAdapter = list[Update]


def load_adapter_weights(
    adapter: Adapter, targets: LoRATargets, dtype: torch.dtype, device: torch.device
) -> LoadedAdapter:
    """Read and check `adapter`'s weights against the wrapped projections (ValueError)."""
    where = f"adapter {adapter.name!r}"
    try:
        tensors = load_file(adapter.path / WEIGHTS_FILE)
    except Exception as exc:  # safetensors' own errors: a truncated or foreign file
        raise ValueError(f"{where}: {WEIGHTS_FILE} cannot be read ({exc})") from None
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"{where}: weight {key!r} is not a LoRA update kvserve applies")
        layer, path, half = int(match[1]), match[2], match[3]
        fused = _FUSED_EXPERTS.match(path)
        if fused is not None:
            path = _expert_parameter(adapter, layer, fused[1], fused[2].count("."), key)
        halves.setdefault((layer, path), {})[half] = tensor
    updates: LoadedAdapter = []
    for (layer, path), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise ValueError(f"{where}: {path} of layer {layer} has no {missing}")
        rank, scaling = adapter.rank_and_scaling(f"model.layers.{layer}.{path}")
        parameter = path.rsplit(".", 1)[-1]
        if (layer, path) in targets.projections:
            found = [targets.projections[(layer, path)]]
        elif path.endswith(tuple(f"experts.{p}" for p in EXPERT_PARAMETERS)):
            found = targets.expert_parameters.get((layer, parameter), [])
        else:
            found = []
        if not found:
            raise ValueError(
                f"{where}: weights of {path} of layer {layer}: this base model has no such "
                "projection (or kvserve does not adapt it)"
            )
        lora_a, lora_b = pair["A"], pair["B"]
        count = len(found)  # the experts (one per fused weight) or the one module
        _, width = found[0].part_offsets[parameter]
        want_a, want_b = (rank * count, in_features(found[0])), (width, rank * count)
        if tuple(lora_a.shape) != want_a or tuple(lora_b.shape) != want_b:
            raise ValueError(
                f"{where}: {path} of layer {layer} has lora_A {tuple(lora_a.shape)} and "
                f"lora_B {tuple(lora_b.shape)}; the base model needs {want_a} and {want_b} "
                "(an adapter for another base model?)"
            )
        lora_a = lora_a.to(device=device, dtype=dtype).view(count, rank, -1)
        lora_b = lora_b.to(device=device, dtype=dtype).view(width, rank, count)
        for expert, projection in enumerate(found):
            a, b = lora_a[expert].contiguous(), lora_b[:, :, expert].contiguous()
            updates.append(Update(projection, parameter, a, b, scaling))
    if not updates:
        raise ValueError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    _check_disjoint(updates, where)
    return updates


def _expert_parameter(adapter: Adapter, layer: int, experts: str, depth: int, key: str) -> str:
    """The fused weight a key of `experts` adapts: of the layer's targeted ones, in their
    module's order (gate_up_proj, down_proj), the first is the innermost wrapper."""
    prefix = f"model.layers.{layer}.{experts}"
    targeted = [p for p in EXPERT_PARAMETERS if _targets(adapter, f"{prefix}.{p}")]
    if depth >= len(targeted):
        raise ValueError(
            f"adapter {adapter.name!r}: weight {key!r} adapts a fused expert weight its "
            f"target_parameters ({', '.join(adapter.target_parameters) or 'none'}) do not name"
        )
    return f"{experts}.{targeted[len(targeted) - 1 - depth]}"


def _targets(adapter: Adapter, key: str) -> bool:
    """PEFT's match of a parameter: its full path, or a suffix after a dot."""
    return any(key == t or key.endswith(f".{t}") for t in adapter.target_parameters)


def _check_disjoint(updates: LoadedAdapter, where: str) -> None:
    """Two updates of the same rows (a fused weight and its parts, say) would both apply."""
    taken: dict[int, list[tuple[int, int, str]]] = {}
    for u in updates:
        offset, width = u.projection.part_offsets[u.part]
        for start, end, other in taken.setdefault(id(u.projection), []):
            if offset < end and start < offset + width:
                raise ValueError(f"{where}: {u.part} and {other} adapt the same projection")
        taken[id(u.projection)].append((offset, offset + width, u.part))


def in_features(projection: LoRAProjection) -> int:
    """The width a projection reads (its adapters' lora_A columns)."""
    base = projection.base
    width = getattr(base, "in_features", None)
    if isinstance(width, int):
        return width
    weight = getattr(base, "weight", None)
    return int(weight.shape[1]) if isinstance(weight, torch.Tensor) else -1
