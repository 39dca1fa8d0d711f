"""lora.py's served half: `kvserve serve` and vLLM's CPU build serving the same adapters.

Run: .venv/bin/python benchmarks/lora.py --vllm [--vllm-adapters 4] [--rank 16] [--threads 2]
         [--dtype bfloat16] [--served-prompts 32] [--concurrency 8] [--eager]
         [--vllm-python ~/.venvs/vllm-cpu/bin/python]

vLLM runs from its own virtual environment (cpu_vs_vllm.py says how to make it)
through the same CLI shim, on the same weights: the default model's GGUF
dequantized once to an HF directory (gguf_to_hf.py), cast to `--dtype` by both.
The adapters: `--adapters` random PEFT directories (lora.write_adapter, rank
`--rank`, every projection). Each server in turn starts with
`--enable-lora --max-loras K --max-lora-rank R --lora-modules a0=DIR ...` (and its
thread setting as in cpu_vs_vllm.py); `vllm bench serve` then runs random 128-token
prompts to 64 tokens (EOS ignored), `--served-prompts` at concurrency
`--concurrency`, twice: on the base model, then with the adapters assigned round
robin (`--lora-modules a0 a1 ... --lora-assignment round-robin`). The table: output
tok/s of each, adapters over base, and kvserve's adapter tok/s over vLLM's (the
issue's target: at least 1.0x).
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
from pathlib import Path

import cpu_vs_vllm_served as served
from cpu_vs_vllm import engine_env
from gguf_to_hf import DEFAULT_OUT, write_hf_directory
from machine import machine_line


def workloads(adapters: int, prompts: int, concurrency: int) -> list[served.Workload]:
    load = ("--backend", "openai", "--endpoint", "/v1/completions", "--dataset-name", "random",
            "--random-input-len", "128", "--random-output-len", "64", "--num-prompts",
            str(prompts), "--max-concurrency", str(concurrency), "--num-warmups", "2")  # fmt: skip
    names = [f"a{i}" for i in range(adapters)]
    lora = ("--lora-modules", *names, "--lora-assignment", "round-robin")
    return [served.Workload("base", load), served.Workload("adapters", (*load, *lora))]


def run_served(args: argparse.Namespace, write_adapter, tmp: Path) -> None:
    from kvserve.default_model import default_model_path

    model = write_hf_directory(default_model_path(), DEFAULT_OUT)
    served.VLLM_PYTHON[:] = [str(args.vllm_python)]
    paths = [tmp / f"a{i}" for i in range(args.vllm_adapters)]
    for i, path in enumerate(paths):
        write_adapter(path, str(model), args.rank, seed=i)
    extra = ("--enable-lora", "--max-loras", str(len(paths)), "--max-lora-rank", str(args.rank),
             "--lora-modules", *(f"a{i}={p}" for i, p in enumerate(paths)))  # fmt: skip
    loads = workloads(len(paths), args.served_prompts, args.concurrency)
    results: dict[str, dict | str] = {}
    for engine in ("kvserve", "vLLM"):
        env = engine_env(engine, args.threads, args.vllm_python)
        try:
            results[engine] = served.run_server(
                engine.lower(), str(model), args.dtype, args.threads, env, loads,
                eager=args.eager, extra=extra,
            )  # fmt: skip
        except RuntimeError as exc:  # vLLM's LoRA on the CPU may fail: say exactly how
            results[engine] = str(exc)
    ask = "import importlib.metadata as m; print(m.version('vllm-cpu'))"
    found = subprocess.run([str(args.vllm_python), "-c", ask], capture_output=True, text=True)
    print(f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC  "
          f"{machine_line(args.threads)}; vllm-cpu {found.stdout.strip() or '?'}")  # fmt: skip
    print(f"# {model} ({args.dtype}); {len(paths)} adapters of rank {args.rank}; "
          f"{args.served_prompts} prompts 128 -> 64 tokens at concurrency {args.concurrency}"
          f"{'; vLLM with --enforce-eager' if args.eager else ''}")  # fmt: skip
    print()
    print("| server | start s | base tok/s | adapters tok/s | adapters / base | vs vLLM |")
    print("|---|---|---|---|---|---|")
    vllm = results.get("vLLM")
    for engine, r in results.items():
        if isinstance(r, str):
            print(f"| {engine} | failed: {r.splitlines()[0]} | | | | |")
            continue
        base, tuned = r["base"]["output_throughput"], r["adapters"]["output_throughput"]
        ratio = ""
        if engine == "kvserve" and isinstance(vllm, dict):
            ratio = f"{tuned / vllm['adapters']['output_throughput']:.2f}x"
        print(f"| {engine} | {r['start_s']:.0f} | {base:.1f} | {tuned:.1f} | "
              f"{tuned / base:.2f}x | {ratio} |")  # fmt: skip
    for engine, r in results.items():
        if isinstance(r, str):
            print(f"\n{engine} failed:\n{r}")
