"""Paged attention of a whole step in one compiled FlexAttention call (attention_backend
"flex"), for a GPU; the plain path (kvserve.model.attention.plain) stays the CPU's default.

Per layer, once paged_attention has written the batch's new K/V into the paged cache
(design.md invariant 8), every sequence's context is gathered from it through the step's
packed key slots (kvserve.model.attention.flex_metadata) and all queries (prefills, chunked
prefills, decodes together) attend in one kernel, the BlockMask skipping the tiles
no query of theirs reaches. Grouped-query attention through enable_gqa (kv heads
never repeated); Gemma-style soft-capping as a score_mod.

The kernel is torch.compile(flex_attention) with static shapes: the metadata pads
token and key counts to a few buckets, each compiled once (dynamic shapes do not
compile on the CPU in torch 2.13), and the recompile limit is raised so the buckets
never fall back to the unfused eager path.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch
from torch.nn.attention.flex_attention import flex_attention

from kvserve.model.attention.flex_metadata import FlexMetadata

RECOMPILE_LIMIT = 128
"""Compiled variants kept: one per (query bucket, key bucket, head layout, dtype, soft-cap
or not) met. Token buckets 128..8192 and key buckets 128..2**19 could meet 91 pairs;
a step's two counts grow together, so far fewer do."""


@cache
def compiled_flex_attention() -> Callable[..., torch.Tensor]:
    """torch.compile(flex_attention), built on first use (importing this module compiles
    nothing)."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(flex_attention, dynamic=False)


def flex_attention_read(
    q: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    meta: FlexMetadata,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """The read half of paged_attention (which has written the step's K/V): queries
    [T, heads, head_dim] over their contexts in the flat caches ([slots, kv_heads,
    head_dim]), returns [T, heads * head_dim]; `softcap` caps the scaled scores
    (softcap * tanh(score / softcap)) before the softmax."""
    num, heads, dim = q.shape
    padded = meta.block_mask.seq_lengths[0]
    query = q.new_zeros(padded, heads, dim)
    # The scale goes into the queries as they are padded (no extra pass): the kernel's own
    # scale stays 1.0, and a Python float there would compile one kernel per model.
    torch.mul(q, scale, out=query[:num])
    # [1, heads, tokens, dim] views of the packed rows: the kernel takes their strides.
    keys = k_flat.index_select(0, meta.kv_slots).transpose(0, 1)[None]
    values = v_flat.index_select(0, meta.kv_slots).transpose(0, 1)[None]
    out = compiled_flex_attention()(
        query.transpose(0, 1)[None],
        keys,
        values,
        score_mod=None if softcap is None else _softcap_mod(softcap, q.device),
        block_mask=meta.block_mask,
        scale=1.0,
        enable_gqa=True,
    )
    return out[0, :, :num].transpose(0, 1).reshape(num, heads * dim)


@cache
def _softcap_mod(softcap: float, device: torch.device) -> Callable[..., torch.Tensor]:
    """softcap * tanh(score / softcap), the cap a tensor: one compiled kernel for every
    cap value (a Python float would be baked into the kernel)."""
    cap = torch.tensor(softcap, device=device)

    def score_mod(
        score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> torch.Tensor:
        return torch.tanh(score / cap) * cap

    return score_mod
