"""The CPU's C kernels (kvserve/model/cpu_kernels) against the torch ops they replace (issue 28).

Run: .venv/bin/python benchmarks/cpu_kernels.py [--threads 2] [--repeat 30] [--no-steps]
         [--dtype bfloat16|float32]

Ops: the default model's shapes (9 query heads, 3 kv heads, head size 64; hidden
576, intermediate 1,536) in `--dtype` (float32: the kernels as a fast float32
runner's step runs them, inside its float32 scope), each timed as the median of `--repeat`
calls after a warm-up, the kernel against torch's path in the same process:
decode attention (kernel: in place through the slots; torch: index_select of
the context, then SDPA), a fresh prefill's causal attention (kernel against
SDPA's flash kernel), RMSNorm with its residual add, the rotary embedding,
SiLU-and-multiply. Steps: whole `LLMEngine.step`s of the default model in one
subprocess each, $KVSERVE_CPU_KERNELS=1 against 0: decode steps of 8 requests
(256-token prompts) and 64 (60-70-token prompts), prefills of 4 x 256 and
1 x 1,000 tokens (prefix cache off; float32 the fast mode, not exact); the median
step. Ratios are kernel / torch (below 1: the kernels are faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime

import torch
import torch.nn.functional as F
from machine import machine_line

from kvserve.model.cpu_kernels.float32_scope import float32_kernels

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
HEADS, KV_HEADS, DIM, HIDDEN, INTERMEDIATE = 9, 3, 64, 576, 1536


def median_us(fn: Callable[[], object], repeat: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def op_rows(repeat: int, dtype: torch.dtype) -> list[tuple[str, float, float]]:
    from kvserve.model.checkpoint.config import RopeConfig
    from kvserve.model.cpu_kernels import attention, layer_ops
    from kvserve.model.layers.common import RMSNorm, RotaryEmbedding, apply_rotary

    built = [attention.enable(), layer_ops.enable()]
    kernels, fused = attention.kernel(), layer_ops.ops()
    if kernels is None or fused is None:
        sys.exit(f"no CPU kernels here: {[b.reason for b in built]}")
    gen = torch.Generator().manual_seed(0)
    rows: list[tuple[str, float, float]] = []
    k_flat = torch.randn(64000, KV_HEADS, DIM, generator=gen).to(dtype)
    v_flat = torch.randn(64000, KV_HEADS, DIM, generator=gen).to(dtype)
    for batch, length in ((1, 300), (8, 256), (16, 100), (64, 100), (4, 2000)):
        slots = torch.randint(1, 64000, (batch, length), generator=gen)
        bounds = torch.tensor([[0, length]] * batch, dtype=torch.int32)
        query = torch.randn(batch, HEADS, DIM, generator=gen).to(dtype)

        def gathered(slots=slots, query=query, batch=batch) -> torch.Tensor:
            keys = k_flat.index_select(0, slots.view(-1)).view(*slots.shape, KV_HEADS, DIM)
            values = v_flat.index_select(0, slots.view(-1)).view(*slots.shape, KV_HEADS, DIM)
            q = query.view(batch, KV_HEADS, HEADS // KV_HEADS, DIM)
            return F.scaled_dot_product_attention(
                q, keys.transpose(1, 2), values.transpose(1, 2), scale=DIM**-0.5
            )

        rows.append((
            f"decode attention, {batch} x {length} keys",
            median_us(lambda s=slots, b=bounds, q=query: kernels.decode(
                q, k_flat, v_flat, s, b, DIM**-0.5), repeat),
            median_us(gathered, repeat),
        ))  # fmt: skip
    for length in (256, 1000):
        qkv = torch.randn(length, HEADS + 2 * KV_HEADS, DIM, generator=gen).to(dtype)
        q, k, v = qkv.split([HEADS, KV_HEADS, KV_HEADS], dim=1)
        out = torch.empty(length, HEADS, DIM, dtype=dtype)
        if dtype not in kernels.prefill_dtypes:
            continue
        rows.append((
            f"prefill attention, {length} tokens",
            median_us(lambda q=q, k=k, v=v, o=out: kernels.prefill(q, k, v, o, DIM**-0.5), repeat),
            median_us(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                is_causal=True, scale=DIM**-0.5, enable_gqa=True), repeat),
        ))  # fmt: skip
    norm = RMSNorm(HIDDEN, 1e-5).to(dtype)
    rope = RotaryEmbedding(RopeConfig(theta=100000.0), DIM, torch.device("cpu"))
    for count in (8, 64, 1024):
        x = torch.randn(count, HIDDEN, generator=gen).to(dtype)
        delta = torch.randn(count, HIDDEN, generator=gen).to(dtype)
        qk = torch.randn(count, HEADS + 2 * KV_HEADS, DIM, generator=gen).to(dtype)[:, :12]
        cos, sin = rope.cos_sin(torch.arange(count), dtype)
        gate_up = torch.randn(count, 2 * INTERMEDIATE, generator=gen).to(dtype)

        def torch_norm(x=x, delta=delta) -> torch.Tensor:
            layer_ops._ops = None
            try:
                return norm(x.add_(delta))
            finally:
                layer_ops._ops = fused

        def torch_rotary(qk=qk, cos=cos, sin=sin) -> torch.Tensor:
            layer_ops._ops = None
            try:
                return apply_rotary(qk, cos, sin)
            finally:
                layer_ops._ops = fused

        def torch_silu(gate_up=gate_up, count=count) -> torch.Tensor:
            gate, up = gate_up.view(count, 2, -1).unbind(1)
            return F.silu(gate) * up

        rows += [
            (f"add + RMSNorm, {count} rows",
             median_us(lambda x=x, d=delta: fused.rms_norm(x, norm.weight, 1e-5, d), repeat),
             median_us(torch_norm, repeat)),
            (f"rotary, {count} rows x 12 heads",
             median_us(lambda qk=qk, c=cos, s=sin: fused.rotary(qk, c, s), repeat),
             median_us(torch_rotary, repeat)),
            (f"SiLU x up, {count} rows",
             median_us(lambda g=gate_up: fused.silu_mul(g), repeat),
             median_us(torch_silu, repeat)),
        ]  # fmt: skip
    return rows


STEP = """
import json, os, random, statistics, sys, time
from kvserve import LLM, SamplingParams
from kvserve.default_model import default_model_path
llm = LLM(str(default_model_path()), dtype=sys.argv[2], num_threads=int(sys.argv[1]),
          enable_prefix_caching=False)
engine, rng, result = llm.engine, random.Random(0), {}
def add(tag, count, length, max_tokens):
    for i in range(count):
        prompt = [rng.randrange(1000, 40000) for _ in range(length + i % 11)]
        engine.add_request(f"{tag}{i}", prompt, SamplingParams(max_tokens=max_tokens,
                           ignore_eos=True, temperature=0))
for count, length in ((8, 256), (64, 60)):
    add(f"d{count}-", count, length, 40)
    engine.step()
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter(); engine.step(); times.append(time.perf_counter() - start)
    result[f"decode step, {count} requests"] = statistics.median(times[3:]) * 1e3
for count, length in ((4, 256), (1, 1000)):
    times = []
    for rep in range(4):
        add(f"p{count}-{rep}-", count, length, 1)
        start = time.perf_counter(); engine.step(); times.append(time.perf_counter() - start)
        while engine.has_unfinished_requests():
            engine.step()
    result[f"prefill step, {count} x {length} tokens"] = statistics.median(times[1:]) * 1e3
print(json.dumps(result))
"""


def step_rows(threads: int, dtype: str) -> list[tuple[str, float, float]]:
    results = {}
    for switch in ("1", "0"):
        env = {**os.environ, "KVSERVE_CPU_KERNELS": switch}
        done = subprocess.run(
            [sys.executable, "-c", STEP, str(threads), dtype],
            env=env, capture_output=True, text=True, check=True,
        )  # fmt: skip
        results[switch] = json.loads(done.stdout.strip().splitlines()[-1])
    return [(name, ms * 1e3, results["0"][name] * 1e3) for name, ms in results["1"].items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--no-steps", action="store_true", help="the ops only")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC  {machine_line(args.threads)}, "
          f"torch {torch.__version__}, {args.dtype}")  # fmt: skip
    with float32_kernels(args.dtype == "float32"):  # what a fast float32 step opens
        rows = op_rows(args.repeat, DTYPES[args.dtype])
    rows += [] if args.no_steps else step_rows(args.threads, args.dtype)
    print(f"{'':<40} {'C kernel':>12} {'torch':>12} {'ratio':>7}")
    for name, kernel_us, torch_us in rows:
        unit, scale = ("ms", 1e3) if torch_us >= 1e4 else ("us", 1.0)
        print(f"{name:<40} {kernel_us / scale:>9.1f} {unit} {torch_us / scale:>9.1f} {unit} "
              f"{kernel_us / torch_us:>6.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
