"""The Triton kernels of the "triton" attention backend (their launchers, and why they
look as they do: kvserve.model.attention.triton_attention).

`store_kv_kernel` writes a step's new K/V at their flat slots, skipping slot -1.
`paged_attention_kernel` runs one program per (sequence, kv head, tile of its queries or
split of its context): rows are query tokens times the query heads sharing the kv head;
it walks the context key tile by key tile, each key's page looked up in the block table,
with an online softmax in float32. `merge_splits_kernel` combines a split decode's
partial outputs.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
    Part,
    Lse,
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
    SPLITS: tl.constexpr,
):
    """Out[t, h] = softmax over the sequence's keys p with q - window < p <= q (q: the
    token's position) of cap(Q[t, h] . K[p] * scale), times V[p].

    With SPLITS > 1 (decodes only: grid axis 2 is the split, not a query tile) each
    program covers one of SPLITS equal ranges of the context and writes its normalized
    partial output to Part [T, heads, SPLITS, HEAD_DIM_P2] and its log-sum-exp to Lse
    [T, heads, SPLITS] (float32), for merge_splits_kernel."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    if SPLITS > 1:
        q_tile = 0
        split = tl.program_id(2)
    else:
        q_tile = tl.program_id(2)
        split = 0
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
        if SPLITS > 1:  # this program's share of [lo, hi), whole key tiles
            share = tl.cdiv(tl.cdiv(hi - lo, SPLITS), TILE) * TILE
            lo = lo + split * share
            hi = tl.minimum(hi, lo + share)
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
        if SPLITS > 1:
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(l_i))
            part = ((first + tok) * (tl.num_programs(1) * GROUP) + head) * SPLITS + split
            tl.store(Lse + part, lse, mask=row_ok)
            tl.store(Part + part[:, None] * HEAD_DIM_P2 + dims[None, :], out, mask=row_ok[:, None])
        else:
            tl.store(
                Out
                + (first + tok)[:, None] * stride_ot
                + head[:, None] * stride_oh
                + dims[None, :],
                out.to(Out.dtype.element_ty),
                mask=row_ok[:, None] & dim_ok[None, :],
            )


@triton.jit
def merge_splits_kernel(
    Part,
    Lse,
    Out,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """One program per (token, head): its SPLITS partial outputs weighted by their share
    of the softmax mass, exp(lse - max lse); a split that saw no key weighs 0."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    row = t * tl.num_programs(1) + h
    splits = tl.arange(0, SPLITS)
    dims = tl.arange(0, HEAD_DIM_P2)
    lse = tl.load(Lse + row * SPLITS + splits)
    top = tl.max(lse, 0)
    weight = tl.exp(lse - tl.where(top == float("-inf"), 0.0, top))
    parts = tl.load(Part + (row * SPLITS + splits)[:, None] * HEAD_DIM_P2 + dims[None, :])
    total = tl.sum(weight, 0)
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        Out + t * stride_ot + h * stride_oh + dims,
        out.to(Out.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )
