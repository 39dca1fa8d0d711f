"""Where one engine step's time goes on the CPU: a batched decode step and a prefill (issue 28).

Run: .venv/bin/python benchmarks/profile_step.py [--dtypes bfloat16 float32] [--threads 2]
         [--quantization none] [--batch 16] [--steps 20] [--top 12]
         [--model PATH] [--no-prefill]

The default model (SmolLM2-135M-Instruct's GGUF, dequantized), one process per
dtype. Decode: `--batch` chat requests (cpu_real.py's, 64+ tokens each) are
prefilled and decoded a few steps unprofiled, then `--steps` decode steps run
under torch.profiler. Prefill: one 1,000-token prompt (cpu_real.py's) to one
token, the prefix cache reset first, after one unprofiled run. Each step is
the whole `LLMEngine.step` (scheduler, KV manager, runner, sampler, outputs).

Printed per step: wall and process CPU time (ms); "torch" is the summed
wall time of the top-level torch ops (those Python called: an op's children
are inside it), "Python" is the rest of the step: the engine, the runner's
and the model's Python, and torch's dispatch from Python before an op's
profiler event opens. Then the top ops by self time (the time in the op
itself, not its children) with their share of the step, grouped by kind.
The profiler adds about 10-20 us per op, counted in "torch"; the unprofiled
wall time per step is printed beside it. `--no-onednn` loads the bfloat16
linear layers unpacked (plain F.linear): the "before" of
kvserve/model/quant/onednn_linear.py.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections import defaultdict

from cpu_real import long_prompt, prompts
from machine import machine_line

KINDS = {
    "GEMM": ("aten::mm", "aten::addmm", "aten::linear", "aten::bmm", "aten::matmul",
             "aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm",
             "aten::_weight_int4pack_mm_for_cpu", "mkldnn", "aten::_linear_pointwise",
             "kvserve::quant_matmul", "kvserve::quant_dequantize"),
    "attention": ("aten::_scaled_dot_product", "aten::scaled_dot_product", "flash"),
    "KV gather / write": ("aten::index_select", "aten::index_copy", "aten::index",
                          "aten::index_put"),
    "sampling": ("aten::argmax", "aten::topk", "aten::sort", "aten::softmax", "aten::multinomial"),
    "fused decode (all layers)": ("kvserve::decode_layers",),
}  # fmt: skip


def kind(name: str) -> str:
    for k, prefixes in KINDS.items():
        if name.startswith(prefixes) or any(
            p in name for p in prefixes if not p.startswith("aten")
        ):
            return k
    return "elementwise, norms, copies, views"


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def profiled(step, steps: int) -> dict:
    """Run `step` `steps` times unprofiled, then under the profiler: the figures per step."""
    from torch.profiler import ProfilerActivity, profile

    t0, c0 = time.perf_counter(), cpu_seconds()
    for _ in range(steps):
        step()
    wall, cpu = (time.perf_counter() - t0) / steps, (cpu_seconds() - c0) / steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        profiled_wall = (time.perf_counter() - t0) / steps
    events = prof.events()
    top = sum(e.cpu_time_total for e in events if e.cpu_parent is None) / 1e6 / steps
    selfs: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for e in events:
        selfs[e.name] += e.self_cpu_time_total / 1e6 / steps
        calls[e.name] += 1
    return {
        "wall": wall,
        "cpu": cpu,
        "profiled_wall": profiled_wall,
        "torch": top,
        "ops_per_step": len(events) / steps,
        "self": dict(selfs),
        "calls": {k: v / steps for k, v in calls.items()},
    }


def worker(
    dtype: str,
    threads: int,
    quantization: str,
    batch: int,
    steps: int,
    onednn: bool,
    model: str | None = None,
    prefill_too: bool = True,
) -> dict:
    from kvserve import LLM, SamplingParams
    from kvserve.model import loader

    if not onednn:  # bfloat16 linears as plain F.linear (the comparison's "before")
        loader.onednn_available = lambda *args, **kwargs: False

    llm = LLM(model, dtype=dtype, num_threads=threads, quantization=quantization)
    engine = llm.engine
    long = long_prompt()
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    counter = iter(range(10**6))

    def prefill() -> None:
        engine.reset_prefix_cache()
        engine.add_request(f"p{next(counter)}", long, one)
        while engine.has_unfinished_requests():
            engine.step()

    result = {}
    if prefill_too:
        prefill()  # warm-up
        result["prefill"] = profiled(prefill, 3)
    chats = prompts(False)[0][:batch]
    while len(chats) < batch:
        chats += chats[: batch - len(chats)]
    many = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
    engine.reset_prefix_cache()
    for i, ids in enumerate(chats):
        engine.add_request(f"d{i}", ids, many)
    for _ in range(5):  # the prefill and a few decode steps
        engine.step()
    result["decode"] = profiled(engine.step, steps)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument(
        "--no-onednn", action="store_true", help="bfloat16 linears unpacked (plain F.linear)"
    )
    parser.add_argument("--model", help="a checkpoint other than the default model")
    parser.add_argument("--no-prefill", action="store_true", help="profile decode steps only")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        r = worker(
            args.worker, args.threads, args.quantization, args.batch, args.steps,
            not args.no_onednn, args.model, not args.no_prefill,
        )  # fmt: skip
        print(json.dumps(r))
        return 0
    print(f"{machine_line(args.threads)} (1 / 5 / 15 min), quantization {args.quantization}, "
          f"batch {args.batch}, oneDNN packing {'off' if args.no_onednn else 'on'}")  # fmt: skip
    for dtype in args.dtypes:
        off = ["--no-onednn"] if args.no_onednn else []
        cmd = [sys.executable, __file__, "--worker", dtype, "--threads", str(args.threads),
               "--quantization", args.quantization, "--batch", str(args.batch),
               "--steps", str(args.steps), *off]  # fmt: skip
        cmd += (["--model", args.model] if args.model else []) + (
            ["--no-prefill"] if args.no_prefill else [])  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        for phase, r in result.items():
            report(dtype, phase, r, args.top)
    return 0


def report(dtype: str, phase: str, r: dict, top: int) -> None:
    ms = r["profiled_wall"] * 1000
    print(f"\n{dtype} {phase}: {r['wall'] * 1000:.1f} ms a step unprofiled "
          f"(CPU {r['cpu'] * 1000:.1f} ms), {ms:.1f} ms profiled, {r['ops_per_step']:.0f} ops; "
          f"torch {r['torch'] * 1000:.1f} ms ({r['torch'] * 1000 / ms:.0%}), "
          f"Python and dispatch {ms - r['torch'] * 1000:.1f} ms "
          f"({1 - r['torch'] * 1000 / ms:.0%})")  # fmt: skip
    kinds: dict[str, float] = defaultdict(float)
    for name, s in r["self"].items():
        kinds[kind(name)] += s
    for k, s in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"  {k:<34} {s * 1000:>8.2f} ms {s * 1000 / ms:>6.1%}")
    print(f"  {'op (self time)':<34} {'ms':>8} {'share':>7} {'calls':>7}")
    for name, s in sorted(r["self"].items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {name[:34]:<34} {s * 1000:>8.2f} {s * 1000 / ms:>7.1%} {r['calls'][name]:>7.0f}")


if __name__ == "__main__":
    sys.exit(main())
