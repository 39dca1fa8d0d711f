"""External KV tiers: prefill saved, throughput and restart TTFT, with and without tiers.

Run: .venv/bin/python benchmarks/offload.py [--repeat N] [--threads N] [--quick]
         [--conversations S] [--turns T] [--restart-prompt N] [--model-dir DIR]

1. Multi-turn. S conversations take T turns each, round robin (turn 1 of every
   conversation, then turn 2 of every conversation, ...). A turn's prompt is the
   conversation's whole history (earlier prompts and the model's answers) plus a
   new user message; token ids are random from a fixed seed, answers greedy. The
   device pool (`num_kv_blocks`) is a quarter of the distinct KV of all the
   conversations, so by the time a conversation's next turn comes, the other
   conversations have pushed its history out of the pool. Three configurations
   run the same turns in one process, one after the other for every repeat
   (A, B, C, A, B, C, ...): no tier, a CPU tier, CPU + disk tiers (a fresh temp
   directory each run). Each run has its own engine, warmed up on an unrelated
   prompt first; engine construction and warm-up are not timed. The greedy
   answers must be the same in every run: the script stops if they are not.
   tokens/s = (prompt + generated tokens of all turns) / wall time of all turns.
2. Restart. Time to first token (TTFT) of one long prompt, each run in a fresh
   process (this script re-invoked): with no tier; with an empty disk tier
   (cold: computes and saves the prompt's KV); and in a second fresh process
   on the same disk directory (warm: loads it). TTFT is the wall time of one
   `generate(max_tokens=1)` after the engine is built and warmed up on a short
   unrelated prompt, so model load and first-call costs are excluded. The warm
   process reads files the cold one has just written, so they are most likely
   in the OS page cache: this is a restart on the same machine, not a read
   from a cold disk.

Checkpoint: the random 46M-parameter Qwen3 of benchmarks/throughput.py
(`ensure_checkpoint`; float32, no tokenizer: token ids), block size 16.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from machine import machine_line
from throughput import MODEL_CONFIG, VOCAB_SIZE, ensure_checkpoint

from kvserve import LLM, SamplingParams

BLOCK_SIZE = 16
WORKLOAD_SEED = 1234
RESTART_SEED = 99
WARM_UP_SEED = 4321
CPU_TIER = "cpu:2GiB"
DISK_SIZE = "4GiB"
COUNTERS = (
    "prefill_tokens_computed",
    "prefix_hit_tokens",
    "external_hit_tokens",
    "generated_tokens",
    "offload_bytes_loaded",
    "offload_bytes_saved",
    "offload_load_seconds",
    "offload_save_seconds",
    "prefill_step_seconds",
    "decode_step_seconds",
)


@dataclass(slots=True)
class Sizes:
    conversations: int
    turns: int
    first: int
    """Tokens of a conversation's first message."""
    message: int
    """Tokens of each later user message."""
    answer: int
    """Tokens of each answer (ignore_eos: always exactly this many)."""
    restart_prompt: int


QUICK = Sizes(conversations=8, turns=2, first=96, message=32, answer=8, restart_prompt=512)
DEFAULT = Sizes(conversations=8, turns=3, first=384, message=64, answer=16, restart_prompt=2000)


def blocks(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


def conversation_tokens(s: Sizes) -> int:
    """Tokens of one conversation's final history (its last answer included)."""
    return s.first + (s.turns - 1) * s.message + s.turns * s.answer


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(2, VOCAB_SIZE) for _ in range(n)]


def engine(model: str, pool_blocks: int, threads: int, offload: str | None) -> LLM:
    return LLM(
        model,
        block_size=BLOCK_SIZE,
        num_kv_blocks=pool_blocks,
        dtype="float32",
        num_threads=threads,
        offload=offload,
    )


def warm_up(llm: LLM) -> None:
    """First calls allocate and pick kernels: keep them out of the timings."""
    rng = random.Random(WARM_UP_SEED)
    prompts = [random_tokens(rng, 40), random_tokens(rng, 70)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)


def counters(llm: LLM) -> dict[str, float]:
    stats = llm.stats()
    return {name: stats.get(name, 0) for name in COUNTERS}


def since(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before[name] for name in COUNTERS}


# -- 1. multi-turn ---------------------------------------------------------------


@dataclass(slots=True)
class Run:
    seconds: float
    tokens: int
    answers: list[list[int]]
    stats: dict[str, float] = field(default_factory=dict)

    def stats_counts(self) -> tuple:
        """The token and byte counters (not the seconds): the same in every repeat."""
        return tuple(v for k, v in self.stats.items() if not k.endswith("seconds"))


def messages(s: Sizes) -> list[list[list[int]]]:
    """messages[turn][conversation]: the new user message of that turn (seeded)."""
    rng = random.Random(WORKLOAD_SEED)
    return [
        [random_tokens(rng, s.first if t == 0 else s.message) for _ in range(s.conversations)]
        for t in range(s.turns)
    ]


def run_multi_turn(
    model: str, s: Sizes, pool_blocks: int, threads: int, offload: str | None
) -> Run:
    llm = engine(model, pool_blocks, threads, offload)
    try:
        warm_up(llm)
        before = counters(llm)
        params = SamplingParams(temperature=0, max_tokens=s.answer, ignore_eos=True)
        history: list[list[int]] = [[] for _ in range(s.conversations)]
        answers = []
        tokens = 0
        t0 = time.perf_counter()
        for turn in messages(s):
            for c, message in enumerate(turn):
                prompt = history[c] + message
                answer = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
                answers.append(answer)
                history[c] = prompt + answer
                tokens += len(prompt) + len(answer)
        seconds = time.perf_counter() - t0
        stats = since(before, counters(llm))
    finally:
        llm.shutdown()
    return Run(seconds, tokens, answers, stats)


def multi_turn(model: str, s: Sizes, repeat: int, threads: int) -> None:
    per_conversation = blocks(conversation_tokens(s))
    working_set = s.conversations * per_conversation
    # A quarter of the working set; one conversation (the longest request) must still fit.
    pool_blocks = max(round(working_set / 4), per_conversation + 1)
    print(
        f"## multi-turn: {s.conversations} conversations x {s.turns} turns (round robin), "
        f"first message {s.first} tokens, later messages {s.message}, answers {s.answer}"
    )
    print(
        f"# distinct KV {working_set} blocks of {BLOCK_SIZE}; device pool {pool_blocks} blocks "
        f"(working set {working_set / pool_blocks:.1f}x the pool); CPU tier {CPU_TIER}\n"
    )
    configs = {
        "no tier": lambda d: None,
        "CPU tier": lambda d: CPU_TIER,
        "CPU + disk tiers": lambda d: f"{CPU_TIER},disk:{d}:{DISK_SIZE}",
    }
    runs: dict[str, list[Run]] = {name: [] for name in configs}
    for r in range(repeat):
        for name, offload in configs.items():
            with tempfile.TemporaryDirectory(prefix="kvserve-offload-bench-") as d:
                run = run_multi_turn(model, s, pool_blocks, threads, offload(d))
            runs[name].append(run)
            print(f"#   repeat {r + 1}/{repeat} {name}: {run.seconds:.2f} s", file=sys.stderr)

    reference = runs["no tier"][0].answers
    for name, rs in runs.items():
        for r, run in enumerate(rs):
            if run.answers != reference:
                pairs = zip(run.answers, reference, strict=True)
                turn = next(i for i, (a, b) in enumerate(pairs) if a != b)
                sys.exit(
                    f"ERROR: greedy answers differ: {name!r} (repeat {r + 1}) first differs from "
                    f"'no tier' (repeat 1) at turn {turn} (round robin order): "
                    f"{run.answers[turn]} != {reference[turn]}. This is an engine bug."
                )
            if run.stats_counts() != rs[0].stats_counts():
                print(f"# note: {name}: token counters differ between repeats", file=sys.stderr)

    base = runs["no tier"]
    base_rate = base[0].tokens / min(run.seconds for run in base)
    base_prefill = base[0].stats["prefill_tokens_computed"]
    print(
        "| configuration | prefill computed | prefix hits | external hits | tokens/s "
        "| wall s (best) | wall s (median) | loaded / saved MB | prefill vs no tier "
        "| tokens/s vs no tier |"
    )
    print("|" + "---|" * 10)
    for name, rs in runs.items():
        st = rs[0].stats
        best = min(run.seconds for run in rs)
        rate = rs[0].tokens / best
        moved = (
            f"{st['offload_bytes_loaded'] / 1e6:,.0f} / {st['offload_bytes_saved'] / 1e6:,.0f}"
            if name != "no tier"
            else "-"
        )
        print(
            f"| {name} | {st['prefill_tokens_computed']:,} | {st['prefix_hit_tokens']:,} "
            f"| {st['external_hit_tokens']:,} | {rate:,.0f} | {best:.2f} "
            f"| {statistics.median(run.seconds for run in rs):.2f} | {moved} "
            f"| {st['prefill_tokens_computed'] / base_prefill:.2f} "
            f"| **{rate / base_rate:.2f}x** |",
            flush=True,
        )
    print(
        f"\n# {base[0].tokens:,} tokens per run (prompts + answers); tokens/s from the best of "
        f"{repeat}; counters from the first repeat"
    )
    print("# where the time goes (first repeat, seconds):")
    for name, rs in runs.items():
        st = rs[0].stats
        tiers = (
            f", offload_load_seconds {st['offload_load_seconds']:.2f}, "
            f"offload_save_seconds {st['offload_save_seconds']:.2f}"
            if name != "no tier"
            else ""
        )
        print(
            f"#   {name}: prefill steps {st['prefill_step_seconds']:.2f}, "
            f"decode steps {st['decode_step_seconds']:.2f}{tiers}"
        )
    print(
        f"# OK: greedy answers identical in all {len(configs) * repeat} runs "
        f"({len(reference)} turns each)\n"
    )


# -- 2. restart -----------------------------------------------------------------


def restart_prompt(n: int) -> list[int]:
    return random_tokens(random.Random(RESTART_SEED), n)


def restart_child(spec: dict) -> None:
    """In a fresh process: build, warm up, time one generate(max_tokens=1); print JSON."""
    prompt = restart_prompt(spec["prompt"])
    pool_blocks = blocks(len(prompt)) + 16
    llm = engine(spec["model"], pool_blocks, spec["threads"], spec["offload"])
    warm_up(llm)
    before = counters(llm)
    t0 = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    ttft = time.perf_counter() - t0
    stats = since(before, counters(llm))
    llm.shutdown()  # the disk tier's queued writes land before the process ends
    result = {"ttft": ttft, "token": out[0].outputs[0].token_ids, **stats}
    result["num_cached_tokens"] = out[0].num_cached_tokens
    print(json.dumps(result))


def run_child(model: str, threads: int, prompt: int, offload: str | None) -> dict:
    spec = {"model": model, "threads": threads, "prompt": prompt, "offload": offload}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--restart-child", json.dumps(spec)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"ERROR: restart child failed ({' '.join(cmd)}):\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def restart(model: str, s: Sizes, repeat: int, threads: int) -> None:
    limit = MODEL_CONFIG["max_position_embeddings"] - 1  # room for the one output token
    n = min(s.restart_prompt, limit)
    print(
        f"## restart: one {n}-token prompt, TTFT in a fresh process each "
        f"(model load and warm-up excluded), disk tier {DISK_SIZE}\n"
    )
    names = ("no tier", "cold (empty disk tier)", "warm (disk tier of the cold run)")
    results: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(repeat):
        with tempfile.TemporaryDirectory(prefix="kvserve-offload-bench-") as d:
            offload = f"disk:{d}:{DISK_SIZE}"
            for name, off in zip(names, (None, offload, offload), strict=True):
                res = run_child(model, threads, n, off)
                results[name].append(res)
                print(f"#   repeat {r + 1}/{repeat} {name}: {res['ttft']:.3f} s", file=sys.stderr)
    tokens = {json.dumps(res["token"]) for rs in results.values() for res in rs}
    if len(tokens) != 1:
        sys.exit(f"ERROR: the first token differs between the restart runs: {sorted(tokens)}")
    warm = results[names[2]]
    if any(res["external_hit_tokens"] == 0 for res in warm):
        sys.exit("ERROR: the warm restart found nothing in the disk tier the cold run filled")
    cold_best = min(res["ttft"] for res in results[names[1]])
    print(
        "| run | TTFT s (best) | TTFT s (median) | prefill computed | external hit tokens "
        "| loaded MB | TTFT vs cold |"
    )
    print("|" + "---|" * 7)
    for name, rs in results.items():
        best = min(res["ttft"] for res in rs)
        loaded = rs[0]["offload_bytes_loaded"] / 1e6 if name != "no tier" else 0
        print(
            f"| {name} | {best:.3f} | {statistics.median(res['ttft'] for res in rs):.3f} "
            f"| {rs[0]['prefill_tokens_computed']:,} | {rs[0]['external_hit_tokens']:,} "
            f"| {loaded:,.1f} | **{best / cold_best:.2f}** |",
            flush=True,
        )
    warm_best = min(res["ttft"] for res in warm)
    print(
        f"\n# TTFT from the best of {repeat}; cold / warm = {cold_best / warm_best:.1f}x; "
        "the same first token in every run"
    )


# -- main -----------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, help="timed runs per configuration (3; 1 with --quick)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    ap.add_argument("--conversations", type=int, help="multi-turn conversations (default 8)")
    ap.add_argument("--turns", type=int, help="turns per conversation (default 3; quick 2)")
    ap.add_argument(
        "--restart-prompt", type=int, help="restart prompt tokens (default 2000; quick 512)"
    )
    ap.add_argument("--model-dir", default=None, help="where the checkpoint is built / reused")
    ap.add_argument("--restart-child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.restart_child:
        restart_child(json.loads(args.restart_child))
        return 0
    overrides = {
        name: getattr(args, name)
        for name in ("conversations", "turns", "restart_prompt")
        if getattr(args, name) is not None
    }
    sizes = replace(QUICK if args.quick else DEFAULT, **overrides)
    repeat = args.repeat or (1 if args.quick else 3)
    if min(repeat, args.threads, sizes.conversations, sizes.turns, sizes.restart_prompt) < 1:
        ap.error("--repeat, --threads, --conversations, --turns, --restart-prompt must be >= 1")

    model = ensure_checkpoint(args.model_dir)
    torch.set_num_threads(args.threads)
    print(
        f"# {datetime.date.today()} {machine_line(args.threads)}, "
        f"torch {torch.__version__}, python {platform.python_version()}, "
        f"repeat {repeat}{', quick' if args.quick else ''}"
    )
    print(f"# checkpoint {model}: random Qwen3 (throughput.py), float32, block size {BLOCK_SIZE}\n")
    multi_turn(model, sizes, repeat, args.threads)
    restart(model, sizes, repeat, args.threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
