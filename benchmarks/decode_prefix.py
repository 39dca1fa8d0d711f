"""Decode steps over shared prompt prefixes, against unrelated prompts, per backend and tree.

Run: .venv/bin/python benchmarks/decode_prefix.py [--trees DIR ...] [--repeat N]
         [--threads T] [--backends plain flex] [--dtype bfloat16] [--tokens 32]
         [--arrivals N]

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

`--arrivals N` measures the served shape instead (`vllm bench serve
--max-concurrency 8`): each run serves N requests of fresh prompts (none
cached before the run; the prefixes are shared within it, request r on
prefix r % 4 for several-prefix), 8 in flight, the next added as soon as
one finishes, through the engine's own step loop. The cells are then the
median CPU (and wall) ms of the steps that only decode; beside them the
steps that also ran a prefill and the run's CPU ms per generated token
(prefills included).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from machine import machine_line

PROMPT_LEN = 256
PREFIX_LEN = 192
ROWS = 8
WORKLOADS = ["unique", "one-prefix", "several-prefix", "identical"]
HERE = Path(__file__).resolve().parents[1]


def prompts(name: str, vocab: int, count: int = ROWS, salt: int = 0) -> list[list[int]]:
    """`count` prompts of the workload; another `salt` gives prompts sharing nothing with
    these (a run of --arrivals finds nothing of an earlier run cached)."""

    def tokens(seed: int, n: int) -> list[int]:
        seed += salt * 1000
        return [(seed * 7919 + i * 104729) % (vocab - 100) + 50 for i in range(n)]

    own = PROMPT_LEN - PREFIX_LEN
    return {
        "unique": lambda: [tokens(100 + r, PROMPT_LEN) for r in range(count)],
        "one-prefix": lambda: [tokens(1, PREFIX_LEN) + tokens(200 + r, own) for r in range(count)],
        "several-prefix": lambda: [
            tokens(2 + r % 4, PREFIX_LEN) + tokens(300 + r, own) for r in range(count)
        ],
        "identical": lambda: [tokens(9, PROMPT_LEN)] * count,
    }[name]()


def serve_like(engine: Any, batch: list[list[int]], params: Any, run: int) -> dict[str, Any]:
    """The batch through the engine's step loop, ROWS in flight, each finished request
    replaced at once (a load tool at fixed concurrency): per-step CPU and wall times."""
    import time

    waiting = iter(enumerate(batch))
    tokens: dict[str, list[int]] = {}
    decode_cpu, decode_wall, mixed = [], [], 0

    def add() -> None:
        item = next(waiting, None)
        if item is not None:
            engine.add_request(f"run{run}-{item[0]:04d}", item[1], params)

    for _ in range(ROWS):
        add()
    cpu0 = time.process_time()
    while engine.has_unfinished_requests():
        cpu, wall = time.process_time(), time.perf_counter()
        outputs = engine.step()
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        if engine.last_step_num_tokens == engine.last_step_num_chunks:  # decodes only
            decode_cpu.append(cpu * 1000)
            decode_wall.append(wall * 1000)
        else:
            mixed += 1
        for output in outputs:
            if output.finished:
                tokens[output.request_id] = output.outputs[0].token_ids
                add()
    generated = sum(map(len, tokens.values()))
    return {
        "ms": statistics.median(decode_cpu),
        "wall": statistics.median(decode_wall),
        "tokens": [tokens[k] for k in sorted(tokens)],
        "mixed": mixed,
        "per_token": (time.process_time() - cpu0) * 1000 / generated,
    }


def worker(args: argparse.Namespace) -> None:
    """One tree's engine: reads 'workload' lines, answers each with one timed run."""
    import time

    from kvserve import LLM, SamplingParams

    llm = LLM(dtype=args.dtype, num_threads=args.threads, attention_backend=args.worker)
    vocab = llm.get_tokenizer().vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    print(json.dumps({"ready": True}), flush=True)
    for run, line in enumerate(sys.stdin):
        if args.arrivals:
            batch = prompts(line.strip(), vocab, args.arrivals, salt=run + 1)
            print(json.dumps(serve_like(llm.engine, batch, params, run)), flush=True)
            continue
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
               "--threads", str(args.threads), "--tokens", str(args.tokens),
               "--arrivals", str(args.arrivals)]  # fmt: skip
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
    parser.add_argument("--workloads", nargs="+", default=WORKLOADS, choices=WORKLOADS)
    parser.add_argument("--arrivals", type=int, default=0, help="served shape: N requests a run")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    trees = [str(Path(t).resolve()) for t in args.trees]
    shape = f"{ROWS} requests x {PROMPT_LEN}-token prompts (cached)"
    if args.arrivals:
        shape = f"{args.arrivals} requests x {PROMPT_LEN}-token prompts (fresh), {ROWS} in flight"
    print(
        f"# {datetime.date.today()}, {machine_line()}, {args.threads} thread(s) a worker, "
        "one worker at a "
        f"time, {args.dtype}, SmolLM2-135M-Instruct, {shape} x {args.tokens} greedy tokens, "
        f"{args.repeat} runs a cell, trees alternating"
    )
    for i, tree in enumerate(trees):
        print(f"# tree {i}: {tree}")
    print(f"{'backend':8} {'workload':15} {'tree':>4} {'CPU ms/step':>17} {'x unique':>8} "
          f"{'x first':>8} {'wall ms/step':>17} {'tokens':>7}"
          + (f" {'prefill steps':>13} {'CPU ms/tok':>10}" if args.arrivals else ""))  # fmt: skip
    for backend in args.backends:
        procs = [start(tree, backend, args) for tree in trees]
        medians: dict[tuple[int, str], float] = {}
        workloads = ["unique", *(w for w in args.workloads if w != "unique")]
        for workload in workloads:
            runs: list[list[float]] = [[] for _ in trees]
            walls: list[list[float]] = [[] for _ in trees]
            tokens: list[list] = [[] for _ in trees]
            extras: list[list[tuple[int, float]]] = [[] for _ in trees]
            for proc in procs:  # caches the prompts (and compiles, for flex)
                if not args.arrivals or backend != "plain":  # fresh prompts: nothing to cache
                    ask(proc, workload)
            for _ in range(args.repeat):
                for i, proc in enumerate(procs):
                    answer = ask(proc, workload)
                    runs[i].append(answer["ms"])
                    walls[i].append(answer["wall"])
                    tokens[i] = answer["tokens"]
                    if args.arrivals:
                        extras[i].append((answer["mixed"], answer["per_token"]))
            for i in range(len(trees)):
                medians[i, workload] = statistics.median(runs[i])
                cell = f"{min(runs[i]):7.1f} ({medians[i, workload]:6.1f})"
                wall = f"{min(walls[i]):7.1f} ({statistics.median(walls[i]):6.1f})"
                vs_unique = medians[i, workload] / medians[i, "unique"]
                vs_first = medians[i, workload] / medians[0, workload]
                same = tokens[i] == tokens[0]
                extra = ""
                if args.arrivals:
                    mixed = statistics.median(m for m, _ in extras[i])
                    extra = f" {mixed:13.0f} {statistics.median(t for _, t in extras[i]):10.1f}"
                print(f"{backend:8} {workload:15} {i:>4} {cell:>17} {vs_unique:8.2f} "
                      f"{vs_first:8.2f} {wall:>17} {same!s:>7}{extra}", flush=True)  # fmt: skip
        for proc in procs:
            proc.stdin.close()
            proc.wait()
    print("cells: min (median) ms per decode step over the runs; ratios of CPU medians")


if __name__ == "__main__":
    main()
