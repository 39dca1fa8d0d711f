"""The float32 kernels (decode attention, the layers' small ops): float32's arithmetic
against float64 and torch's float32 ops, and they run only inside a fast float32
runner's step; an exact runner keeps torch's ops and their bits."""

from __future__ import annotations

import threading

import pytest
import torch

from kvserve.engine.engine_args import EXACT_ENV
from kvserve.model import ModelRunner
from kvserve.model.attention.attention_metadata import AttentionMetadata
from kvserve.model.attention.plain import paged_attention
from kvserve.model.checkpoint.config import RopeConfig
from kvserve.model.cpu_kernels import attention, layer_ops
from kvserve.model.cpu_kernels.float32_scope import float32_kernels, float32_on
from kvserve.model.layers.common import GatedMLP, RMSNorm, RotaryEmbedding, apply_rotary
from tests.model.cpu_kernels.test_attention_kernels import causal_reference, reference
from tests.model.model_driver import generate, prompt

CPU = torch.device("cpu")


def assert_float32_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    """float32's rounding of sums over at most a thousand products: 2^-16 relative, 1e-5
    absolute where the sum cancels (the bfloat16 kernel's rounded probabilities would be
    off by 2^-9 of the values, about 4e-3)."""
    assert out.dtype == torch.float32
    error = (out.double() - expected).abs()
    bound = expected.abs() * 2**-16 + 1e-5
    assert bool((error <= bound).all()), f"worst error {(error - bound).max().item():.2e} over"


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 128), (8, 2, 32)])
def test_float32_decode_through_the_tiles_windows_and_soft_capping(
    attention_kernel, heads, kv_heads, dim
):
    gen = torch.Generator().manual_seed(dim)
    k_flat, v_flat = (torch.randn(4096, kv_heads, dim, generator=gen) for _ in range(2))
    lengths = [*range(1, 41), 1000]
    slots = torch.randint(1, 4096, (len(lengths), max(lengths)), generator=gen)
    bounds = torch.tensor([[0, n] for n in lengths], dtype=torch.int32)
    bounds[-2] = torch.tensor([500, 517])  # a window: keys past the row's start
    query = 4 * torch.randn(len(lengths), heads, dim, generator=gen)  # large scores
    with float32_kernels(True):
        assert attention_kernel.handles(query, k_flat)
        for softcap in (None, 5.0):
            out = attention_kernel.decode(query, k_flat, v_flat, slots, bounds, 0.125, softcap)
            expected = reference(
                query, k_flat, v_flat, slots, bounds, 0.125, softcap, rounded=False
            )
            assert_float32_close(out, expected)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (2, 2, 128), (16, 1, 64)])
def test_float32_prefill_fresh_and_after_a_cached_prefix(attention_kernel, heads, kv_heads, dim):
    """Every length through the tiles (16 positions an item, 4 score rows and 32 keys a
    register tile), fresh and after a cached prefix read through its slots."""
    if torch.float32 not in attention_kernel.prefill_dtypes:
        pytest.skip("no float32 prefill kernel in this build (AVX-512 or AVX2 with FMA)")
    gen = torch.Generator().manual_seed(heads + dim)
    scale = dim**-0.5
    with float32_kernels(True):
        for length in [*range(1, 41), 100]:
            q = 3 * torch.randn(length, heads, dim, generator=gen)
            k, v = (torch.randn(length, kv_heads, dim, generator=gen) for _ in range(2))
            assert attention_kernel.prefills(q, k, v)
            out = torch.empty_like(q)
            attention_kernel.prefill(q, k, v, out, scale)
            assert_float32_close(out, causal_reference(q, k, v, scale, rounded=False))
        k_flat, v_flat = (torch.randn(500, kv_heads, dim, generator=gen) for _ in range(2))
        slots = torch.randperm(499, generator=gen)[:90] + 1
        q = 3 * torch.randn(37, heads, dim, generator=gen)  # positions 53 .. 89
        out = torch.empty_like(q)
        attention_kernel.prefill(q, k_flat, v_flat, out, scale, slots)
        expected = causal_reference(q, k_flat[slots], v_flat[slots], scale, rounded=False)
        assert_float32_close(out, expected)
    assert not attention_kernel.prefills(q, k_flat, v_flat)  # outside a fast step


def test_the_float32_paths_run_only_inside_a_fast_step_of_their_own_thread(attention_kernel, fused):
    query, k_flat = torch.zeros(1, 4, 64), torch.zeros(8, 2, 64)
    x, weight = torch.zeros(3, 64), torch.ones(64)
    outside = (attention_kernel.handles(query, k_flat), fused.takes(x, weight))
    assert outside == (False, False) and fused.silu_mul(torch.zeros(2, 8)) is None
    seen: list[bool] = []
    with float32_kernels(True):
        assert attention_kernel.handles(query, k_flat) and fused.takes(x, weight)
        assert fused.silu_mul(torch.zeros(2, 8)) is not None
        with float32_kernels(False):  # an exact engine's step inside (nested) keeps torch's
            assert not attention_kernel.handles(query, k_flat) and not fused.takes(x, weight)
        worker = threading.Thread(target=lambda: seen.append(float32_on()))
        worker.start()
        worker.join()
        assert float32_on()
    assert seen == [False] and not float32_on()
    assert not attention_kernel.handles(query.bfloat16(), k_flat)  # the cache's dtype too


@pytest.mark.parametrize("rows", [1, 8, 300])
def test_float32_layer_ops_against_torch(fused, monkeypatch, rows):
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576, generator=gen)
    x, delta = (3 * torch.randn(rows, 576, generator=gen) for _ in range(2))
    qkv = torch.randn(rows, 15, 64, generator=gen)
    rope = RotaryEmbedding(RopeConfig(theta=10000.0), 64, CPU)
    cos, sin = rope.cos_sin(torch.randint(0, 4000, (rows,), generator=gen), torch.float32)
    gate_up = 4 * torch.randn(rows, 2 * 1536, generator=gen)
    monkeypatch.setattr(layer_ops, "_ops", None)
    expected_x = x + delta
    expected = (norm(expected_x.clone()), apply_rotary(qkv[:, :12], cos, sin))
    gate, up = gate_up.view(rows, 2, 1536).unbind(1)
    expected_mlp = torch.nn.functional.silu(gate) * up
    with float32_kernels(True):
        out_x = x.clone()
        out = fused.rms_norm(out_x, norm.weight, norm.eps, delta)
        rotated = fused.rotary(qkv[:, :12], cos, sin)
        mlp = fused.silu_mul(gate_up)
    assert torch.equal(out_x, expected_x)
    torch.testing.assert_close(out, expected[0], rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(rotated, expected[1], rtol=2e-6, atol=2e-6)
    assert mlp is not None
    torch.testing.assert_close(mlp, expected_mlp, rtol=2e-6, atol=2e-6)


def test_a_float32_step_attends_through_the_kernel_as_gather_and_sdpa_do(
    attention_kernel, monkeypatch
):
    bs, kv_heads, heads, dim = 16, 2, 6, 64
    gen = torch.Generator().manual_seed(5)
    caches = [torch.randn(80, bs, kv_heads, dim, generator=gen) for _ in range(2)]
    lengths = [int(n) for n in torch.randint(1, 90, (11,), generator=gen)]
    free = iter(torch.randperm(79, generator=gen).add(1).tolist())
    spans = [(n - 1, 1, [next(free) for _ in range(-(-n // bs))], 0) for n in lengths]
    spans.append((0, 20, [next(free), next(free)], 0))  # a fresh prefill
    tokens = len(lengths) + 20
    q = torch.randn(tokens, heads, dim, generator=gen)
    k, v = (torch.randn(tokens, kv_heads, dim, generator=gen) for _ in range(2))
    monkeypatch.setattr(attention, "_kernel", attention_kernel)
    meta = AttentionMetadata.build(spans, bs, CPU)
    plain = paged_attention(q, k, v, *(c.clone() for c in caches), meta, dim**-0.5)
    calls: list[tuple[str, int]] = []
    for name in ("decode", "prefill"):
        real = getattr(attention_kernel, name)
        monkeypatch.setattr(attention_kernel, name, recorded(real, name, calls))
    with float32_kernels(True):
        fast = paged_attention(q, k, v, *(c.clone() for c in caches), meta, dim**-0.5)
    prefilled = torch.float32 in attention_kernel.prefill_dtypes
    assert calls == [("prefill", 20)] * prefilled + [("decode", len(lengths))]
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)


def test_a_fast_float32_runner_steps_through_the_kernels_and_an_exact_one_does_not(
    checkpoints, monkeypatch
):
    if attention.enable().path is None or layer_ops.enable().path is None:
        pytest.skip("no C kernels here")
    monkeypatch.delenv(EXACT_ENV)  # the suite runs exact; the users' default is not

    def runner(exact: bool) -> ModelRunner:
        path = checkpoints["llama"].path
        return ModelRunner(path, block_size=4, num_blocks=64, dtype="float32", exact=exact)

    fast, exact = runner(False), runner(True)
    assert fast.cpu_kernels.float32 and not exact.cpu_kernels.float32
    prompts = [prompt(n, salt=3) for n in (5, 17, 30)]
    calls: list[str] = []
    ops = layer_ops.ops()
    assert ops is not None
    monkeypatch.setattr(GatedMLP, "forward", counted(GatedMLP.forward, calls, "mlp"))
    monkeypatch.setattr(ops, "silu_mul", counted(ops.silu_mul, calls, "kernel"))
    exact_tokens = generate(exact, prompts, 6)
    assert "kernel" not in calls and "mlp" in calls
    calls.clear()
    assert generate(fast, prompts, 6) == exact_tokens  # float32 either way: the same tokens
    assert calls.count("kernel") == calls.count("mlp") > 0


def counted(fn, calls: list[str], name: str):
    def wrapper(*args, **kwargs):
        out = fn(*args, **kwargs)
        if out is not None:
            calls.append(name)
        return out

    return wrapper


def recorded(fn, name: str, calls: list[tuple[str, int]]):
    def wrapper(query, *args):
        calls.append((name, len(query)))
        return fn(query, *args)

    return wrapper
