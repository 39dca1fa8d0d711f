"""One layer's paged attention, backend against backend: decode steps and a prefill step.

Run: .venv/bin/python benchmarks/attention_kernels.py [--device cuda] [--backends ...]

Each case is one layer of Qwen3-0.6B's shape (16 query / 8 kv heads of 128; change
with --heads / --kv-heads / --head-dim) over a paged cache of 16-token blocks in
shuffled order: a decode step of B sequences each with C tokens of context, or a
prefill of N fresh tokens. For every backend (plain torch: kvserve.model.attention.plain,
flex, triton) the metadata is built once, untimed (as the runner does once per step
for all layers), then paged_attention (store the step's K/V, attend) runs --repeat
times after two warm calls; the table gives the median microseconds, each backend's
speed-up over the first (its time against the first's), and for decodes the K/V bytes
read per second by the fastest (B x C x kv_heads x head_dim x 2 x element size over its
time) as a share of --bandwidth-gbs. Every backend's output is compared with the first
backend's; a case whose outputs differ by more than the dtype's rounding stops the run.
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import statistics
import sys
import time

import torch
from machine import machine_line

from kvserve.cli.common import positive
from kvserve.model.attention.plain import paged_attention
from kvserve.model.attention.step_metadata import METADATA_BUILDERS

BLOCK = 16
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def case_spans(batch: int, context: int, prefill: bool, seed: int) -> tuple[list, int]:
    """(spans, blocks needed) of one step over shuffled blocks: `batch` decodes at
    `context` tokens, or one fresh prefill of `context` tokens."""
    per_seq = -(-context // BLOCK)
    seqs = 1 if prefill else batch
    blocks = list(range(1, seqs * per_seq + 1))
    random.Random(seed).shuffle(blocks)
    tables = [blocks[i * per_seq : (i + 1) * per_seq] for i in range(seqs)]
    if prefill:
        return [(0, context, tables[0], 0)], len(blocks) + 1
    return [(context - 1, 1, t, 0) for t in tables], len(blocks) + 1


def run_case(args, device, dtype, batch: int, context: int, prefill: bool) -> dict:
    spans, num_blocks = case_spans(batch, context, prefill, args.seed)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    shape = (num_blocks, BLOCK, args.kv_heads, args.head_dim)
    k_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    k_cache[0] = v_cache[0] = 0
    tokens = sum(n for _, n, _, _ in spans)
    q = torch.randn(tokens, args.heads, args.head_dim, generator=gen, device=device, dtype=dtype)
    k = torch.randn(tokens, args.kv_heads, args.head_dim, generator=gen, device=device,
                    dtype=dtype)  # fmt: skip
    v = torch.randn_like(k)
    scale = args.head_dim**-0.5
    results, reference = {}, None
    for backend in args.backends:
        meta = METADATA_BUILDERS[backend](spans, BLOCK, device, None)
        with torch.inference_mode():
            out = None
            for _ in range(2):  # compiles, selects kernels
                out = paged_attention(q, k, v, k_cache, v_cache, meta, scale)
            times = []
            for _ in range(args.repeat):
                sync(device)
                t0 = time.perf_counter()
                paged_attention(q, k, v, k_cache, v_cache, meta, scale)
                sync(device)
                times.append(time.perf_counter() - t0)
        if reference is None:
            reference = out.float()
        else:
            worst = (out.float() - reference).abs().max().item()
            if worst > (1e-4 if dtype == torch.float32 else 5e-2):
                raise SystemExit(f"{backend} differs from {args.backends[0]} by {worst:.3g}")
        results[backend] = statistics.median(times)
    return results


def table(args, device, dtype) -> list[str]:
    element = torch.empty((), dtype=dtype).element_size()
    base = args.backends[0]
    lines = [
        "| step | " + " | ".join(f"{b} µs" for b in args.backends) + " | "
        + " | ".join(f"{b} speed-up" for b in args.backends[1:])
        + " | best K/V read rate | of bandwidth |",
        "|---" * (2 * len(args.backends) + 2) + "|",
    ]  # fmt: skip
    cases = [(b, c, False) for b in args.batches for c in args.contexts]
    cases += [(1, n, True) for n in args.prefills]
    for batch, context, prefill in cases:
        kv_bytes = batch * context * args.kv_heads * args.head_dim * 2 * element
        if kv_bytes > args.max_cache_gib * 2**30:
            continue
        print(f"running {'prefill' if prefill else 'decode'} {batch} x {context} ...",
              file=sys.stderr, flush=True)  # fmt: skip
        seconds = run_case(args, device, dtype, batch, context, prefill)
        best = min(seconds.values())
        rate = "" if prefill else f"{kv_bytes / best / 1e9:,.0f} GB/s"
        share = "" if prefill else f"{kv_bytes / best / 1e9 / args.bandwidth_gbs:.1%}"
        name = f"prefill {context} tokens" if prefill else f"decode {batch} x {context}"
        lines.append(
            f"| {name} | " + " | ".join(f"{seconds[b] * 1e6:,.0f}" for b in args.backends)
            + " | " + " | ".join(f"{seconds[base] / seconds[b]:.2f}x" for b in args.backends[1:])
            + f" | {rate} | {share} |"
        )  # fmt: skip
    return lines


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    ap.add_argument("--backends", default="plain,flex,triton",
                    help="comma-separated; the first is the baseline")  # fmt: skip
    ap.add_argument("--heads", type=positive, default=16)
    ap.add_argument("--kv-heads", type=positive, default=8)
    ap.add_argument("--head-dim", type=positive, default=128)
    ap.add_argument("--batches", default="1,8,64,256", help="decode batch sizes")
    ap.add_argument("--contexts", default="512,2048,8192", help="decode context lengths")
    ap.add_argument("--prefills", default="512,4096", help="prefill lengths (none: '')")
    ap.add_argument("--repeat", type=positive, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-cache-gib", type=float, default=16.0, help="skip larger cases")
    ap.add_argument("--bandwidth-gbs", type=float, default=3350.0,
                    help="memory bandwidth for the share column (H100 SXM: 3350)")  # fmt: skip
    args = ap.parse_args(argv)
    args.backends = [b for b in args.backends.split(",") if b]
    wrong = [b for b in args.backends if b not in METADATA_BUILDERS]
    if wrong or not args.backends:
        ap.error(f"--backends: each of {', '.join(METADATA_BUILDERS)}, got {wrong or 'none'}")
    try:
        args.batches, args.contexts, args.prefills = (
            [int(x) for x in text.split(",") if x]
            for text in (args.batches, args.contexts, args.prefills)
        )
    except ValueError as exc:
        ap.error(f"--batches, --contexts, --prefills: comma-separated integers ({exc})")
    if args.heads % args.kv_heads:
        ap.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda, but torch sees no CUDA GPU (use --device cpu to smoke-test)")
    off_cuda = not args.device.startswith("cuda")
    if "triton" in args.backends and off_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("triton off CUDA runs only under TRITON_INTERPRET=1 (its interpreter)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if device.type == "cuda":
        where = f"GPU {torch.cuda.get_device_name(device)}"
    else:
        where = f"CPU {machine_line(torch.get_num_threads())}"
    rows = table(args, device, dtype)
    print(f"# {datetime.date.today()}  {where}; torch {torch.__version__}")
    print(f"# one layer: {args.heads} query / {args.kv_heads} kv heads of {args.head_dim}, "
          f"{args.dtype}, blocks of {BLOCK} in shuffled order; median of {args.repeat} calls "
          "after 2 warm ones (store the step's K/V + attend), metadata untimed")  # fmt: skip
    print()
    for line in rows:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
