"""The paged decode attention kernel against float64 attention over the same bfloat16
cache, every context length through the tile boundaries, and inside paged_attention."""

from __future__ import annotations

import pytest
import torch

from kvserve.model.attention.attention_metadata import DECODE_GROUP, AttentionMetadata
from kvserve.model.attention.plain import paged_attention
from kvserve.model.cpu_kernels import attention

BF16 = torch.bfloat16
CPU = torch.device("cpu")


def scattered_cache(num_slots: int, kv_heads: int, dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(num_slots, kv_heads, dim, generator=gen).to(BF16)
    v = torch.randn(num_slots, kv_heads, dim, generator=gen).to(BF16)
    return k, v, gen


def reference(query, k_flat, v_flat, slots, bounds, scale, softcap=None, rounded=True):
    """float64 softmax(q k^T) v of each row over its keys slots[b, begin:end], the
    softmax's weights rounded to bfloat16 before they weight the values (unless not
    `rounded`: float32's kernels keep them)."""
    rows = []
    heads, kv_heads = query.shape[1], k_flat.shape[1]
    for b, (begin, end) in enumerate(bounds.tolist()):
        keys = k_flat[slots[b, begin:end]].double().repeat_interleave(heads // kv_heads, 1)
        values = v_flat[slots[b, begin:end]].double().repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("hd,thd->ht", query[b].double(), keys) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        weights = (scores - scores.amax(-1, keepdim=True)).exp()
        total = weights.sum(-1, keepdim=True)  # SDPA's arithmetic: the weights rounded
        weights = weights.to(BF16).double() if rounded else weights  # to bfloat16, their sum not
        rows.append(torch.einsum("ht,thd->hd", weights, values) / total)
    return torch.stack(rows)


def assert_bfloat16_close(out: torch.Tensor, expected: torch.Tensor, atol: float = 1e-3) -> None:
    """Within bfloat16's rounding of the output (half an ulp, 2^-9 relative) plus the
    float32 arithmetic before it; `atol` for outputs near zero, where the bfloat16 weights'
    own rounding (2^-9 of each weight times its value) is all there is."""
    assert out.dtype == BF16
    error = (out.double() - expected).abs()
    bound = expected.abs() * 2**-8 + atol
    assert bool((error <= bound).all()), f"worst error {(error - bound).max().item():.2e} over"


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 128), (8, 2, 32)])
def test_every_context_length_through_the_tiles(attention_kernel, heads, kv_heads, dim):
    """Rows of 1..40 keys (tiles of 16 full, partial, single) from shuffled slots."""
    k_flat, v_flat, gen = scattered_cache(4096, kv_heads, dim, seed=dim)
    lengths = list(range(1, 41))
    width = max(lengths)
    slots = torch.zeros(len(lengths), width, dtype=torch.long)
    for b, n in enumerate(lengths):
        slots[b, :n] = torch.randperm(4095, generator=gen)[:n] + 1
    bounds = torch.tensor([[0, n] for n in lengths], dtype=torch.int32)
    query = torch.randn(len(lengths), heads, dim, generator=gen).to(BF16)
    out = attention_kernel.decode(query, k_flat, v_flat, slots, bounds, dim**-0.5)
    assert_bfloat16_close(out, reference(query, k_flat, v_flat, slots, bounds, dim**-0.5))


def test_windows_long_contexts_and_soft_capping(attention_kernel):
    """Rows whose keys start past the padding (a sliding window), 1,000 keys, soft-cap."""
    k_flat, v_flat, gen = scattered_cache(8192, 2, 64, seed=1)
    width = 1000
    slots = torch.randint(1, 8192, (3, width), generator=gen)
    bounds = torch.tensor([[0, 1000], [990, 1000], [500, 517]], dtype=torch.int32)
    query = (4 * torch.randn(3, 8, 64, generator=gen)).to(BF16)  # large scores
    for softcap in (None, 5.0):
        out = attention_kernel.decode(query, k_flat, v_flat, slots, bounds, 0.125, softcap)
        expected = reference(query, k_flat, v_flat, slots, bounds, 0.125, softcap)
        assert_bfloat16_close(out, expected)


def test_shapes_it_does_not_compute_are_refused(attention_kernel):
    k_flat, v_flat, _ = scattered_cache(64, 2, 72, seed=2)
    query = torch.zeros(1, 4, 72, dtype=BF16)
    assert not attention_kernel.handles(query, k_flat)  # 72 is no multiple of 16
    slots = torch.ones(1, 3, dtype=torch.long)
    bounds = torch.tensor([[0, 3]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="refused 1 rows of 4 heads of 72"):
        attention_kernel.decode(query, k_flat, v_flat, slots, bounds, 0.1)
    assert not attention_kernel.handles(query.float(), k_flat.float())


@pytest.mark.parametrize("window", [None, 24])
def test_paged_attention_runs_the_kernels_as_gather_and_sdpa_do(
    attention_kernel, monkeypatch, window
):
    """A step of 2 x DECODE_GROUP + 3 decodes of mixed lengths (with a window) and one
    fresh prefill: the kernel reads every decode in one call (one group, no padding), the
    prefill (causal, no window) by the prefill kernel, and the rows equal those of gather +
    SDPA over sorted padded groups and of SDPA's flash kernel within bfloat16 rounding."""
    bs, kv_heads, heads, dim = 16, 2, 6, 64
    gen = torch.Generator().manual_seed(3)
    caches = [torch.randn(200, bs, kv_heads, dim, generator=gen).to(BF16) for _ in range(2)]
    for cache in caches:
        cache[0].zero_()
    lengths = [int(n) for n in torch.randint(1, 90, (2 * DECODE_GROUP + 3,), generator=gen)]
    free = iter(torch.randperm(199, generator=gen).add(1).tolist())
    spans = [(n - 1, 1, [next(free) for _ in range(-(-n // bs))], 0) for n in lengths]
    spans.append((0, 20, [next(free), next(free)], 0))
    tokens = len(lengths) + 20
    q = torch.randn(tokens, heads, dim, generator=gen).to(BF16)
    k, v = (torch.randn(tokens, kv_heads, dim, generator=gen).to(BF16) for _ in range(2))
    calls: list[tuple[str, int]] = []

    class Counted:
        can_prefill = attention_kernel.can_prefill
        handles, prefills = attention_kernel.handles, attention_kernel.prefills

        def decode(self, query, *args):
            calls.append(("decode", query.shape[0]))
            return attention_kernel.decode(query, *args)

        def prefill(self, query, *args):
            calls.append(("prefill", query.shape[0]))
            return attention_kernel.prefill(query, *args)

    monkeypatch.setattr(attention, "_kernel", Counted())
    meta = AttentionMetadata.build(spans, bs, CPU, window=window)
    assert len(meta.decodes) == 1 and meta.decodes[0].bounds is not None  # one group, in order
    fast = paged_attention(q, k, v, *(c.clone() for c in caches), meta, dim**-0.5)
    prefilled = window is None and attention_kernel.can_prefill
    assert calls == [("prefill", 20)] * prefilled + [("decode", len(lengths))]
    monkeypatch.setattr(attention, "_kernel", None)
    meta = AttentionMetadata.build(spans, bs, CPU, window=window)
    assert len(meta.decodes) == 3  # sorted groups of DECODE_GROUP for gather + SDPA
    plain = paged_attention(q, k, v, *(c.clone() for c in caches), meta, dim**-0.5)
    torch.testing.assert_close(fast.float(), plain.float(), atol=2e-2, rtol=2e-2)
    if not prefilled:  # SDPA's flash kernel ran the prefill both times
        assert torch.equal(fast[len(lengths) :], plain[len(lengths) :])


def causal_reference(q, k, v, scale, rounded=True):
    """float64 causal attention of the last len(q) positions of a sequence over its keys
    (all of k), the weights rounded to bfloat16 unless not `rounded` (as in `reference`)."""
    length, heads, kv_heads = q.shape[0], q.shape[1], k.shape[1]
    context = k.shape[0]
    keys = k.double().repeat_interleave(heads // kv_heads, 1)
    values = v.double().repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("thd,shd->hts", q.double(), keys) * scale
    positions = torch.arange(context - length, context)[:, None]
    scores = scores.masked_fill(torch.arange(context)[None, :] > positions, -torch.inf)
    weights = (scores - scores.amax(-1, keepdim=True)).exp()
    total = weights.sum(-1, keepdim=True)
    weights = weights.to(BF16).double() if rounded else weights
    return torch.einsum("hts,shd->thd", weights / total, values)


@pytest.fixture(params=["avx512", "amx"])
def prefill_kernel(request, attention_kernel):
    """The bfloat16 prefill on AVX-512 BF16's loops, then on AMX tiles where the CPU has
    them (prefill_attention_amx.h; tiles back on after)."""
    if not attention_kernel.can_prefill:
        pytest.skip("this machine's build has no prefill kernel (AVX-512 bfloat16)")
    on = attention_kernel.use_tiles(request.param == "amx")
    if request.param == "amx" and not on:
        pytest.skip("no AMX tiles here")
    yield attention_kernel
    attention_kernel.use_tiles(True)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (2, 2, 128)])
def test_a_fresh_prefill_at_every_length_through_the_tiles(prefill_kernel, heads, kv_heads, dim):
    """Every length from 1 to 70 (query and key tiles of 16: full, partial, single) and
    300, read out of a fused qkv row (strided views), written into a slice of a batch."""
    attention_kernel = prefill_kernel
    gen = torch.Generator().manual_seed(dim)
    for length in [*range(1, 71), 300]:
        qkv = torch.randn(length, heads + 2 * kv_heads, dim, generator=gen).to(BF16)
        q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
        assert attention_kernel.prefills(q, k, v)
        batch = torch.full((length + 2, heads, dim), 7.0, dtype=BF16)
        attention_kernel.prefill(q, k, v, batch[1 : length + 1], dim**-0.5)
        assert_bfloat16_close(batch[1 : length + 1], causal_reference(q, k, v, dim**-0.5))
        assert bool((batch[0] == 7).all() and (batch[-1] == 7).all())  # nothing else written
    with pytest.raises(ValueError, match="contiguous"):
        attention_kernel.prefill(q, k, v, batch[:, :1], dim**-0.5)


def test_a_prefill_after_a_cached_prefix_reads_its_keys_in_place(prefill_kernel):
    """Queries at the last positions of contexts of every length 1..50 (and 300 after
    200 cached), their keys scattered over a flat cache through their slots."""
    attention_kernel = prefill_kernel
    heads, kv_heads, dim = 9, 3, 64
    k_flat, v_flat, gen = scattered_cache(4096, kv_heads, dim, seed=5)
    cases = [(context, new) for context in range(1, 51) for new in {1, context // 2 + 1, context}]
    for context, new in [*cases, (300, 100)]:
        slots = torch.randperm(4095, generator=gen)[:context] + 1
        q = torch.randn(new, heads, dim, generator=gen).to(BF16)
        out = torch.empty(new, heads, dim, dtype=BF16)
        attention_kernel.prefill(q, k_flat, v_flat, out, dim**-0.5, slots)
        expected = causal_reference(q, k_flat[slots], v_flat[slots], dim**-0.5)
        assert_bfloat16_close(out, expected, atol=4e-3)  # one output of 0.004 was 0.006
    with pytest.raises(RuntimeError, match="refused 5 queries over 4 keys"):
        attention_kernel.prefill(q[:5], k_flat, v_flat, out[:5], dim**-0.5, slots[:4])


def test_a_rows_prefill_does_not_depend_on_the_rows_before_it(prefill_kernel):
    """A prompt's last 37 rows after its first 63 were cached, and in 3 chunks, get the
    bits of the whole prompt's prefill, on either path; the two paths agree to rounding."""
    heads, kv_heads, dim, length = 9, 3, 64, 100
    k_flat, v_flat, gen = scattered_cache(4096, kv_heads, dim, seed=9)
    slots = torch.randperm(4095, generator=gen)[:length] + 1
    q = torch.randn(length, heads, dim, generator=gen).to(BF16)
    whole = torch.empty(length, heads, dim, dtype=BF16)
    prefill_kernel.prefill(q, k_flat, v_flat, whole, dim**-0.5, slots)
    for first, last in ((63, 100), (0, 17), (17, 50), (50, 100)):
        part = torch.empty(last - first, heads, dim, dtype=BF16)
        prefill_kernel.prefill(q[first:last], k_flat, v_flat, part, dim**-0.5, slots[:last])
        assert torch.equal(part, whole[first:last])
    other = torch.empty_like(whole)
    prefill_kernel.use_tiles(not prefill_kernel.tiles)  # the other path, where there is one
    prefill_kernel.prefill(q, k_flat, v_flat, other, dim**-0.5, slots)
    expected = causal_reference(q, k_flat[slots], v_flat[slots], dim**-0.5)
    assert_bfloat16_close(other, expected, atol=4e-3)
