"""Paged attention in Triton (attention_backend "triton"): every query of a step, prefill
chunk or decode, attends in one kernel launch per layer that reads its context straight
from the paged cache through the block tables: no gather, no per-sequence loop.

Two kernels. `store_kv` writes the step's new K/V at their slots (a slot of -1 is not
written: a position that already holds its K/V, or a CUDA graph's padding row), before
any query reads (design.md invariant 8). `paged_attention_kernel` runs one program per
(sequence, kv head, tile of the sequence's queries): the tile's rows are its query
tokens times the query heads that share the kv head (grouped-query attention with the
kv heads never repeated), and it walks the context key tile by key tile, each key's page
looked up in the block table, with an online softmax in float32. Causality, sliding
windows and Gemma's soft-cap are applied per score inside the kernel.

Metadata (kvserve.model.paged_metadata) is a few small tensors built once per step, and
the launch grid depends only on the batch size and its longest chunk: a decode step has a
fixed grid for a fixed batch size, which is what a CUDA graph needs
(kvserve.model.decode_graphs).

Triton compiles for GPUs. On the CPU the kernels run only in Triton's interpreter
(TRITON_INTERPRET=1 in the environment before triton is first imported), which executes
the same kernels with numpy: exact and very slow, for tests (the runner refuses the
backend on the CPU otherwise: kvserve.model.step_metadata.check_backend).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvserve.model.paged_metadata import PagedMetadata

DECODE_TILE = 32
PREFILL_TILE = 64
"""Keys per inner step of a decode kernel and of a prefill one (its tile has more query
rows to share each loaded key with); a page (block) may hold any number of tokens."""
MIN_DOT = 16
"""tl.dot needs at least 16 rows and a reduction of at least 16 on a GPU."""


@triton.jit
def store_kv_kernel(
    K,
    V,
    k_cache,
    v_cache,
    slots,
    stride_kt,
    stride_vt,
    stride_ks,
    stride_vs,
    ROW: tl.constexpr,
    ROW_P2: tl.constexpr,
):
    """One program per token: its [kv_heads * head_dim] row of K and of V to its slot."""
    t = tl.program_id(0)
    slot = tl.load(slots + t)
    if slot >= 0:
        cols = tl.arange(0, ROW_P2)
        ok = cols < ROW
        k = tl.load(K + t * stride_kt + cols, mask=ok)
        v = tl.load(V + t * stride_vt + cols, mask=ok)
        tl.store(k_cache + slot * stride_ks + cols, k, mask=ok)
        tl.store(v_cache + slot * stride_vs + cols, v, mask=ok)


@triton.jit
def paged_attention_kernel(
    Q,
    k_cache,
    v_cache,
    Out,
    query_start,
    seq_starts,
    block_tables,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    block_size,
    scale,
    softcap,
    window,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    TILE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Out[t, h] = softmax over the sequence's keys p with q - window < p <= q (q: the
    token's position) of cap(Q[t, h] . K[p] * scale), times V[p]."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2)
    first = tl.load(query_start + seq)
    q_len = tl.load(query_start + seq + 1) - first
    if q_tile * BLOCK_Q < q_len:
        start = tl.load(seq_starts + seq)
        rows = tl.arange(0, BLOCK_Q * GROUP_P2)
        tok = q_tile * BLOCK_Q + rows // GROUP_P2
        in_group = rows % GROUP_P2
        row_ok = (tok < q_len) & (in_group < GROUP)
        head = kv_head * GROUP + in_group
        pos = start + tok
        dims = tl.arange(0, HEAD_DIM_P2)
        dim_ok = dims < HEAD_DIM
        q = tl.load(
            Q + (first + tok)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
            mask=row_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        if UPCAST:  # bfloat16 products are exact in float32: the same scores
            q = q.to(tl.float32)
        # Keys this tile may reach: up to its last query's position, from its first
        # query's window on.
        hi = start + tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len)
        lo = 0
        if WINDOW:
            lo = tl.maximum(start + q_tile * BLOCK_Q - window + 1, 0)
        m_i = tl.full([BLOCK_Q * GROUP_P2], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * GROUP_P2], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_P2, HEAD_DIM_P2], tl.float32)
        for n0 in range(lo, hi, TILE):
            kpos = n0 + tl.arange(0, TILE)
            k_ok = kpos < hi
            page = tl.load(block_tables + seq * stride_bt + kpos // block_size, mask=k_ok, other=0)
            page = page.to(tl.int64)  # page * stride can pass 2**31 in a large pool
            offset = kpos % block_size
            kv_mask = k_ok[:, None] & dim_ok[None, :]
            k = tl.load(
                k_cache
                + page[:, None] * stride_kb
                + offset[:, None] * stride_ks
                + kv_head * stride_kh
                + dims[None, :],
                mask=kv_mask,
                other=0.0,
            )
            v = tl.load(
                v_cache
                + page[:, None] * stride_vb
                + offset[:, None] * stride_vs
                + kv_head * stride_vh
                + dims[None, :],
                mask=kv_mask,
                other=0.0,
            )
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            if SOFTCAP:
                s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)  # softcap * tanh
            allowed = k_ok[None, :] & (kpos[None, :] <= pos[:, None])
            if WINDOW:
                allowed = allowed & (kpos[None, :] > pos[:, None] - window)
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row with no key yet (padding, or a window not reached) keeps m = -inf:
            # exp against 0 instead of -inf - -inf.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            Out + (first + tok)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
            out.to(Out.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )


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
) -> torch.Tensor:
    """paged_attention for the "triton" backend: store the step's K/V, then queries [T,
    heads, head_dim] over their paged contexts; returns [T, heads * head_dim]."""
    _check_cache(k_cache)
    _check_cache(v_cache)
    store_kv(k, v, k_cache, v_cache, meta.slots)
    if q.stride(2) != 1:
        q = q.contiguous()
    tokens, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    constants = attention_constants(
        q.dtype, heads, kv_heads, dim, meta.max_query_len == 1, softcap, meta.window
    )
    out = torch.empty(tokens, heads, dim, dtype=q.dtype, device=q.device)
    grid = (meta.num_seqs, kv_heads, triton.cdiv(meta.max_query_len, constants["BLOCK_Q"]))
    paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
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
    return out.view(tokens, heads * dim)


def attention_constants(
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    dim: int,
    decode_only: bool,
    softcap: float | None,
    window: int | None,
) -> dict[str, int | bool | str]:
    """The attention kernel's compile-time constants for one layer shape and step kind:
    each distinct set is one compiled kernel."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    group = heads // kv_heads
    group_p2 = triton.next_power_of_2(group)
    # A tile of a decode is its one token; a prefill's tile holds enough tokens for the
    # rows to reach MIN_DOT (more rows: fewer passes over the same keys).
    block_q = max(1, (MIN_DOT if decode_only else 64) // group_p2)
    return dict(
        GROUP=group,
        GROUP_P2=group_p2,
        BLOCK_Q=block_q,
        HEAD_DIM=dim,
        HEAD_DIM_P2=max(MIN_DOT, triton.next_power_of_2(dim)),
        TILE=DECODE_TILE if decode_only else PREFILL_TILE,
        SOFTCAP=softcap is not None,
        WINDOW=window is not None,
        # float32 stays float32 (no TF32): the oracle tests compare greedy tokens.
        PRECISION="ieee" if dtype == torch.float32 or interpreted else "tf32",
        # Triton 3.9's interpreter multiplies bfloat16 matrices wrongly: it gets float32.
        UPCAST=interpreted and dtype == torch.bfloat16,
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
