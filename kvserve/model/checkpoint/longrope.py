"""LongRoPE (Phi-3's "su" scaling): its parameters as transformers reads them.

Each rotary frequency is divided by a per-frequency factor: `short_factor`
for positions inside the original context (`original_max_position_embeddings`),
`long_factor` beyond it, and cos and sin are both multiplied by one
`attention_factor` (given, or sqrt(1 + ln(factor) / ln(original)) with factor the
context's extension ratio).

transformers uses one set for the whole sequence: short while the sequence fits
the original context, and once it grows past it, `generate` drops its cache and
recomputes every position with the long set. A paged cache shared between
requests cannot recompute a request's K/V in place, so kvserve picks the set per
token from its own position (vLLM's rule): a cached block's K/V then depends
only on its tokens and positions. The two agree token for token while prompt and
output fit the original context (Phi-3-mini-128k's: 4096 tokens); past it,
kvserve's earlier positions keep the short set where transformers would recompute
them with the long one.
"""

from __future__ import annotations

import math
from typing import Any

from kvserve.model.checkpoint.errors import ModelLoadError

ROPE_TYPE_ALIASES = {"Phi3ForCausalLM": {"su": "longrope", "yarn": "longrope"}}
"""Older rope type names an architecture's config class renames (Phi3Config's rule)."""


def longrope_parameters(
    merged: dict[str, Any], raw: dict[str, Any], rotary_dim: int
) -> dict[str, Any]:
    """The RopeConfig fields of a longrope config (`merged`: its rope parameters); each
    factor list holds one factor per rotated pair (`rotary_dim` / 2; 0: unchecked)."""
    original = merged.get("original_max_position_embeddings") or raw.get(
        "original_max_position_embeddings"
    )
    if not isinstance(original, int) or original < 1:
        raise ModelLoadError(
            f"rope scaling 'longrope' needs a positive original_max_position_embeddings, "
            f"got {original!r}"
        )
    factors = {}
    for key in ("short_factor", "long_factor"):
        value = merged.get(key)
        if not isinstance(value, list) or not value:
            raise ModelLoadError(f"rope scaling 'longrope' needs a list {key!r}, got {value!r}")
        if rotary_dim and len(value) != rotary_dim // 2:
            raise ModelLoadError(
                f"rope scaling 'longrope' needs {rotary_dim // 2} {key} values (one per "
                f"rotated pair of {rotary_dim} dims), got {len(value)}"
            )
        factors[key] = tuple(float(v) for v in value)
    factor = merged.get("factor")
    if factor is None:
        factor = int(raw.get("max_position_embeddings", original)) / original
    attention_factor = merged.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    return {
        **factors,
        "factor": float(factor),
        "attention_factor": float(attention_factor),
        "original_max_position_embeddings": original,
    }
