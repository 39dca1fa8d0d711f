"""An adapter's PEFT weights read into (layer, module) -> (lora_A, lora_B), checked.

PEFT saves `base_model.model.<the base's module path>.lora_A.weight` ([rank, in]) and
`...lora_B.weight` ([out, rank]). Every key must name a projection the base model
has and kvserve wraps (layers.attach_lora), with the base's widths: a mismatch is
one line naming the key, the shape and what the base expects.
"""

from __future__ import annotations

import re

import torch
from safetensors.torch import load_file

from kvserve.lora.layers import LoRAProjection
from kvserve.lora.request import WEIGHTS_FILE, Adapter

_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(\w+)\.lora_([AB])(?:\.\w+)?\.weight$"
)

LoadedAdapter = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
"""(layer index, PEFT module name) -> (lora_A [rank, in], lora_B [out, rank])."""


def load_adapter_weights(
    adapter: Adapter,
    projections: dict[tuple[int, str], LoRAProjection],
    dtype: torch.dtype,
    device: torch.device,
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
        layer, module, half = int(match[1]), match[2], match[3]
        if (layer, module) not in projections:
            raise ValueError(
                f"{where}: weight {key!r} targets {module} of layer {layer}, which this base "
                "model does not have (or kvserve does not adapt)"
            )
        halves.setdefault((layer, module), {})[half] = tensor
    loaded: LoadedAdapter = {}
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise ValueError(f"{where}: {module} of layer {layer} has no {missing}")
        lora_a, lora_b = pair["A"], pair["B"]
        projection = projections[(layer, module)]
        _, width = projection.part_offsets[module]
        fan_in = in_features(projection)
        want_a, want_b = (adapter.rank, fan_in), (width, adapter.rank)
        if tuple(lora_a.shape) != want_a or tuple(lora_b.shape) != want_b:
            raise ValueError(
                f"{where}: {module} of layer {layer} has lora_A {tuple(lora_a.shape)} and "
                f"lora_B {tuple(lora_b.shape)}; the base model needs {want_a} and {want_b} "
                "(an adapter for another base model?)"
            )
        loaded[(layer, module)] = (
            lora_a.to(device=device, dtype=dtype).contiguous(),
            lora_b.to(device=device, dtype=dtype).contiguous(),
        )
    if not loaded:
        raise ValueError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    return loaded


def in_features(projection: LoRAProjection) -> int:
    """The width a projection reads (its adapters' lora_A columns)."""
    base = projection.base
    width = getattr(base, "in_features", None)
    if isinstance(width, int):
        return width
    weight = getattr(base, "weight", None)
    return int(weight.shape[1]) if isinstance(weight, torch.Tensor) else -1
