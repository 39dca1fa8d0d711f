"""Which layers attend through a sliding window, read the way each architecture's
transformers config reads it.

Three shapes exist among the architectures kvserve runs:

- per-layer types (Gemma 2 and 3): `layer_types` lists `sliding_attention` /
  `full_attention`; older configs give a period instead (`sliding_window_pattern`,
  Gemma 3's default 6; Gemma 2 alternates, sliding first);
- one window for every layer (Mistral, Phi-3): `sliding_window` set means all
  layers slide (transformers builds one sliding mask for the whole model); null
  means none. MistralConfig defaults a missing key to 4096, Phi3Config to null;
- none (Llama, Qwen2, Qwen3, ...): a config that asks for a window anyway is
  refused rather than run without it.

A window W means a token at position p reads keys p-W+1 .. p (transformers'
`kv_idx > q_idx - W`).
"""

from __future__ import annotations

from typing import Any

from kvserve.model.checkpoint.errors import ModelLoadError

PER_LAYER_WINDOWS = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6}
"""Architectures whose layers alternate by `layer_types`, with the default period (every
period-th layer is global) when a config has neither layer_types nor a pattern."""
UNIFORM_WINDOWS: dict[str, int | None] = {
    "MistralForCausalLM": 4096,
    "Phi3ForCausalLM": None,
}
"""Architectures with one optional window for all layers: the default when the key is absent."""


def layer_windows(raw: dict[str, Any], arch: str, num_layers: int) -> list[int | None]:
    """Per layer its window (None: full attention); [] when every layer is full."""
    if arch in PER_LAYER_WINDOWS:
        return _per_layer_windows(raw, num_layers, PER_LAYER_WINDOWS[arch])
    if arch in UNIFORM_WINDOWS:
        window = raw.get("sliding_window", UNIFORM_WINDOWS[arch])
        if window is None:
            return []
        return [_positive_window(window)] * num_layers
    _reject_sliding_window(raw)
    return []


def _positive_window(window: Any) -> int:
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ModelLoadError(f"sliding layers need a positive 'sliding_window', got {window!r}")
    return window


def _reject_sliding_window(raw: dict[str, Any]) -> None:
    """Sliding-window layers need their own KV group; refuse rather than run them wrong."""
    layer_types = raw.get("layer_types") or []
    sliding = any(t != "full_attention" for t in layer_types)
    if not layer_types and raw.get("use_sliding_window") and raw.get("sliding_window"):
        sliding = True
    if sliding:
        raise ModelLoadError(
            "sliding-window attention layers are not supported for this architecture "
            f"(layer_types={sorted(set(layer_types)) or 'use_sliding_window'})"
        )


def _per_layer_windows(raw: dict[str, Any], num_layers: int, period: int) -> list[int | None]:
    """Per-layer windows from `layer_types` (or the older `sliding_window_pattern`)."""
    types = raw.get("layer_types")
    if not types:
        pattern = int(raw.get("sliding_window_pattern") or period)
        types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        ]
    if len(types) != num_layers:
        raise ModelLoadError(f"layer_types has {len(types)} entries for {num_layers} layers")
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ModelLoadError(f"layer types {sorted(unknown)} are not supported")
    if raw.get("use_bidirectional_attention"):
        raise ModelLoadError("use_bidirectional_attention is not supported")
    if "sliding_attention" not in types:
        return [None] * num_layers
    window = _positive_window(raw.get("sliding_window"))
    return [window if t == "sliding_attention" else None for t in types]
