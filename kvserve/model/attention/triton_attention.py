"""Paged attention in Triton (attention_backend "triton"): every query of a step, prefill
chunk or decode, attends in one kernel launch per layer that reads its context straight
from the paged cache through the block tables: no gather, no per-sequence loop.

The kernels (kvserve.model.attention.triton_kernels): `store_kv` writes the step's new K/V at
their slots (a slot of -1 is not written: a position that already holds its K/V, or a CUDA
graph's padding row) before any query reads (design.md invariant 8); the attention
kernel gives each (sequence, kv head, tile of its queries) a program whose rows are the
tile's tokens times the query heads sharing that kv head (grouped-query attention, the
kv heads never repeated), walking the context through the block table in key tiles with
an online softmax in float32; causality, sliding windows and Gemma's soft-cap are
applied per score inside it. A decode step whose batch is too small to fill the GPU
splits each context into ranges (flash-decoding) and merges their partial results.

Metadata (kvserve.model.attention.paged_metadata) is a few small tensors built once per step, and
the launch grid depends only on the batch size and its longest chunk: a decode step has a
fixed grid for a fixed batch size, which is what a CUDA graph needs
(kvserve.model.attention.decode_graphs).

Triton compiles for GPUs. On the CPU the kernels run only in Triton's interpreter
(TRITON_INTERPRET=1 in the environment before triton is first imported), which executes
the same kernels with numpy: exact and very slow, for tests (the runner refuses the
backend on the CPU otherwise: kvserve.model.attention.step_metadata.check_backend).
"""

from __future__ import annotations

import os
from functools import cache
from typing import TypedDict

import torch
import triton

from kvserve.model.attention.paged_metadata import PagedMetadata
from kvserve.model.attention.triton_kernels import (
    merge_splits_kernel,
    paged_attention_kernel,
    store_kv_kernel,
)

MIN_DOT = 16
"""tl.dot needs at least 16 rows and a reduction of at least 16 on a GPU."""
PREFILL_SIZES = {256: (64, 64), 512: (64, 32), 1024: (32, 16)}
"""Bytes of one head row (head_dim, padded, times the element size) -> query rows and keys
per inner step of a prefill kernel: as large as keeps its shared memory under the 99 KiB
that every NVIDIA GPU since Ampere can give a kernel (a test compiles every variant and
checks). A decode kernel has MIN_DOT rows (its token's query heads, padded) and
DECODE_TILE keys."""
DECODE_TILE = 32


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Write [T, kv_heads, head_dim] keys and values into the paged caches ([num_blocks,
    block_size, kv_heads, head_dim]) at their flat slots; a slot of -1 is skipped."""
    if k.shape[0] == 0:
        return
    row = k.shape[1] * k.shape[2]
    k, v = _rows(k), _rows(v)
    store_kv_kernel[(k.shape[0],)](
        k,
        v,
        k_cache,
        v_cache,
        slots,
        k.stride(0),
        v.stride(0),
        k_cache.stride(1),
        v_cache.stride(1),
        ROW=row,
        ROW_P2=triton.next_power_of_2(row),
    )


def triton_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedMetadata,
    scale: float,
    softcap: float | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """paged_attention for the "triton" backend: store the step's K/V, then queries [T,
    heads, head_dim] over their paged contexts; returns [T, heads * head_dim].

    A decode step's contexts are cut into `splits` ranges (default: decode_splits) when
    the batch alone would leave the GPU's multiprocessors idle."""
    _check_cache(k_cache)
    _check_cache(v_cache)
    store_kv(k, v, k_cache, v_cache, meta.slots)
    if q.stride(2) != 1:
        q = q.contiguous()
    tokens, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    decode_only = meta.max_query_len == 1
    if not decode_only:
        splits = 1
    elif splits is None:
        splits = decode_splits(meta.num_seqs * kv_heads, q.device)
    constants = attention_constants(q.dtype, heads, kv_heads, dim, decode_only, softcap,
                                    meta.window, splits)  # fmt: skip
    out = torch.empty(tokens, heads, dim, dtype=q.dtype, device=q.device)
    if splits > 1:
        lse = torch.empty(tokens, heads, splits, dtype=torch.float32, device=q.device)
        part = torch.empty(tokens, heads, splits, constants["HEAD_DIM_P2"],
                           dtype=torch.float32, device=q.device)  # fmt: skip
        axis2 = splits
    else:
        lse = part = out  # not read
        axis2 = triton.cdiv(meta.max_query_len, constants["BLOCK_Q"])
    paged_attention_kernel[(meta.num_seqs, kv_heads, axis2)](
        q,
        k_cache,
        v_cache,
        out,
        part,
        lse,
        meta.query_start,
        meta.seq_starts,
        meta.block_tables,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        meta.block_tables.stride(0),
        k_cache.shape[1],
        scale,
        0.0 if softcap is None else float(softcap),
        0 if meta.window is None else meta.window,
        **constants,
    )
    if splits > 1:
        merge_splits_kernel[(tokens, heads)](
            part, lse, out, out.stride(0), out.stride(1), HEAD_DIM=dim,
            HEAD_DIM_P2=constants["HEAD_DIM_P2"], SPLITS=splits,
        )  # fmt: skip
    return out.view(tokens, heads * dim)


MAX_SPLITS = 16
PROGRAMS_PER_SM = 2
"""A decode launch aims at this many programs per multiprocessor (splitting contexts
until it gets there, at most MAX_SPLITS ways)."""


def decode_splits(programs: int, device: torch.device) -> int:
    """How many ways to split each context of a decode step of `programs` (sequence, kv
    head) pairs: 1 off CUDA, and wherever the batch fills the GPU by itself. It depends on
    the batch size only, so a CUDA graph's bucket has one value."""
    if device.type != "cuda":
        return 1
    target = PROGRAMS_PER_SM * _multiprocessors(device)
    splits = 1
    while splits < MAX_SPLITS and programs * splits < target:
        splits *= 2
    return splits


@cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


class AttentionConstants(TypedDict):
    """The attention kernel's compile-time constants, and its launch's warps."""

    GROUP: int
    GROUP_P2: int
    BLOCK_Q: int
    HEAD_DIM: int
    HEAD_DIM_P2: int
    TILE: int
    SOFTCAP: bool
    WINDOW: bool
    PRECISION: str
    UPCAST: bool
    SPLITS: int
    num_warps: int


@cache
def attention_constants(
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    dim: int,
    decode_only: bool,
    softcap: float | None,
    window: int | None,
    splits: int = 1,
) -> AttentionConstants:
    """The attention kernel's compile-time constants (and its warps) for one layer shape
    and step kind: each distinct set is one compiled kernel. Asked per layer and step,
    so cached (the dict is shared: read it, never change it)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    group = heads // kv_heads
    group_p2 = triton.next_power_of_2(group)
    dim_p2 = max(MIN_DOT, triton.next_power_of_2(dim))
    row_bytes = dim_p2 * dtype.itemsize
    rows, tile = (MIN_DOT, DECODE_TILE)
    if not decode_only:  # more rows: fewer passes over the same keys
        rows, tile = next((v for k, v in PREFILL_SIZES.items() if row_bytes <= k), (16, 16))
    return AttentionConstants(
        GROUP=group,
        GROUP_P2=group_p2,
        BLOCK_Q=max(1, rows // group_p2),  # a decode's tile is its one token
        HEAD_DIM=dim,
        HEAD_DIM_P2=dim_p2,
        TILE=tile,
        SOFTCAP=softcap is not None,
        WINDOW=window is not None,
        # float32 stays float32 (no TF32): the oracle tests compare greedy tokens.
        PRECISION="ieee" if dtype == torch.float32 or interpreted else "tf32",
        # Triton 3.9's interpreter multiplies bfloat16 matrices wrongly: it gets float32.
        UPCAST=interpreted and dtype == torch.bfloat16,
        SPLITS=splits,
        # A launch option, not a constant: a prefill program's 64 rows spill registers
        # with 4 warps (ptxas, sm_90: 1.5 KB a thread for Qwen3-0.6B; 48 bytes with 8).
        num_warps=4 if decode_only else 8,
    )


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[T, kv_heads, head_dim] with each token's heads contiguous (one row per token)."""
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        x = x.contiguous()
    return x


def _check_cache(cache: torch.Tensor) -> None:
    """The kernels index a page's heads and dims with unit inner strides, and a flat slot
    as block * block_size + offset."""
    if (
        cache.stride(3) != 1
        or cache.stride(2) != cache.shape[3]
        or cache.stride(0) != cache.shape[1] * cache.stride(1)
    ):
        raise ValueError("the triton backend needs K/V pages laid out [..., kv_heads, head_dim]")
