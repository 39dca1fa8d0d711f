"""Decode steps over shared prompt prefixes, against unrelated prompts, per backend and tree.

Run: .venv/bin/python benchmarks/decode_prefix.py [--trees DIR ...] [--repeat N]
         [--threads T] [--backends plain flex] [--dtype bfloat16] [--tokens 32]

A decode row whose prompt shares blocks with other rows (identical prompts,
`n` > 1, a common system prompt) should cost no more than an unshared one.
This script measures ms per decode step of an 8-row batch on the default model
(SmolLM2-135M-Instruct, dequantized) for:
- unique: 8 unrelated 256-token prompts;
- one-prefix: one 192-token prefix + 64 tokens of each request's own;
- several-prefix: 4 prefixes of 192 tokens, 2 requests on each (+ 64 own);
- identical: 8 copies of one block-aligned 256-token prompt.

Each timed run generates `--tokens` greedy tokens per request (EOS ignored)
after the same prompts were run once, so the prompts are cached and the run is
almost only decode steps: time / tokens = ms per step, as the process's CPU
time (what the step costs; with one thread, little disturbed by other work on
a busy machine) and as wall time. `--trees` names
kvserve source trees to compare (a checkout's root, put first on the import
path of a worker process; default: this one), e.g. a worktree of another
commit: their workers alternate run by run, so the machine's drift spreads
over all of them. Cells: min (median) of `--repeat` runs; "x unique" is the
row's median over the same tree's unique median; "x first" the median over
the first tree's for the same row; "tokens" whether the greedy tokens equal
the first tree's.
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
from pathlib import Path

PROMPT_LEN = 256
PREFIX_LEN = 192
ROWS = 8
WORKLOADS = ["unique", "one-prefix", "several-prefix", "identical"]
HERE = Path(__file__).resolve().parents[1]


def prompts(name: str, vocab: int) -> list[list[int]]:
    def tokens(seed: int, n: int) -> list[int]:
        return [(seed * 7919 + i * 104729) % (vocab - 100) + 50 for i in range(n)]

    own = PROMPT_LEN - PREFIX_LEN
    return {
        "unique": lambda: [tokens(100 + r, PROMPT_LEN) for r in range(ROWS)],
        "one-prefix": lambda: [tokens(1, PREFIX_LEN) + tokens(200 + r, own) for r in range(ROWS)],
        "several-prefix": lambda: [
            tokens(2 + r % 4, PREFIX_LEN) + tokens(300 + r, own) for r in range(ROWS)
        ],
        "identical": lambda: [tokens(9, PROMPT_LEN)] * ROWS,
    }[name]()


def worker(args: argparse.Namespace) -> None:
    """One tree's engine: reads 'workload' lines, answers each with one timed run."""
    import time

    from kvserve import LLM, SamplingParams

    llm = LLM(dtype=args.dtype, num_threads=args.threads, attention_backend=args.worker)
    vocab = llm.get_tokenizer().vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        batch = prompts(line.strip(), vocab)
        start, cpu = time.perf_counter(), time.process_time()
        outputs = llm.generate(batch, params, use_tqdm=False)
        wall = (time.perf_counter() - start) * 1000 / args.tokens
        ms = (time.process_time() - cpu) * 1000 / args.tokens
        tokens = [o.outputs[0].token_ids for o in outputs]
        print(json.dumps({"ms": ms, "wall": wall, "tokens": tokens}))
        sys.stdout.flush()


def start(tree: str, backend: str, args: argparse.Namespace) -> subprocess.Popen:
    command = [sys.executable, __file__, "--worker", backend, "--dtype", args.dtype,
               "--threads", str(args.threads), "--tokens", str(args.tokens)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=tree)  # fmt: skip
    assert json.loads(proc.stdout.readline())["ready"]
    return proc


def ask(proc: subprocess.Popen, workload: str) -> dict:
    proc.stdin.write(workload + "\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs="+", default=[str(HERE)])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--backends", nargs="+", default=["plain", "flex"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    trees = [str(Path(t).resolve()) for t in args.trees]
    print(
        f"# {datetime.date.today()}, {platform.machine()}, {os.cpu_count()} cpus, "
        f"{args.threads} thread(s) a worker, one worker at a time, {args.dtype}, "
        f"SmolLM2-135M-Instruct, {ROWS} requests x {PROMPT_LEN}-token prompts (cached) x "
        f"{args.tokens} greedy tokens, {args.repeat} runs a cell, trees alternating"
    )
    for i, tree in enumerate(trees):
        print(f"# tree {i}: {tree}")
    print(f"{'backend':8} {'workload':15} {'tree':>4} {'CPU ms/step':>17} {'x unique':>8} "
          f"{'x first':>8} {'wall ms/step':>17} {'tokens':>7}")  # fmt: skip
    for backend in args.backends:
        procs = [start(tree, backend, args) for tree in trees]
        medians: dict[tuple[int, str], float] = {}
        for workload in WORKLOADS:
            runs: list[list[float]] = [[] for _ in trees]
            walls: list[list[float]] = [[] for _ in trees]
            tokens: list[list] = [[] for _ in trees]
            for proc in procs:
                ask(proc, workload)  # caches the prompts (and compiles, for flex)
            for _ in range(args.repeat):
                for i, proc in enumerate(procs):
                    answer = ask(proc, workload)
                    runs[i].append(answer["ms"])
                    walls[i].append(answer["wall"])
                    tokens[i] = answer["tokens"]
            for i in range(len(trees)):
                medians[i, workload] = statistics.median(runs[i])
                cell = f"{min(runs[i]):7.1f} ({medians[i, workload]:6.1f})"
                wall = f"{min(walls[i]):7.1f} ({statistics.median(walls[i]):6.1f})"
                vs_unique = medians[i, workload] / medians[i, "unique"]
                vs_first = medians[i, workload] / medians[0, workload]
                same = tokens[i] == tokens[0]
                print(f"{backend:8} {workload:15} {i:>4} {cell:>17} {vs_unique:8.2f} "
                      f"{vs_first:8.2f} {wall:>17} {same!s:>7}", flush=True)  # fmt: skip
        for proc in procs:
            proc.stdin.close()
            proc.wait()
    print("cells: min (median) ms per decode step over the runs; ratios of CPU medians")


if __name__ == "__main__":
    main()
