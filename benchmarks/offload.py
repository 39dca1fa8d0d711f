"""External KV tiers: prefill saved and time to first token, with and without tiers.

Run: .venv/bin/python benchmarks/offload.py [--quick] [--threads 1] [--model-dir DIR]

1. Multi-turn: S conversations take turns (round robin); each turn is the
   conversation's whole history (earlier prompts and answers) plus a new
   user message. The device pool holds about a quarter of all the
   conversations' KV, so a conversation's prefix is evicted from the pool
   before its next turn. Three engines run the same turns in one process,
   one after the other: no tier, a CPU tier, CPU + disk tiers (a fresh temp
   directory). Greedy outputs must be identical in all three (checked).
2. Restart: time to first token of one request with a long (2000-token) prefix in
   a fresh process with an empty disk directory (cold), then in a second fresh
   process on the same directory (warm, loaded from disk). Measured inside
   each process from `generate(max_tokens=1)` after the engine is built, so
   model load is excluded.

Checkpoint: the random 46M-parameter Qwen3 of benchmarks/throughput.py
(float32, no tokenizer: token ids).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import VOCAB_SIZE, ensure_checkpoint

from kvserve import LLM, SamplingParams

BLOCK = 16


def turns(conversations: int, num_turns: int, first: int, message: int, answer: int):
    """(conversation, new user message) in round-robin order; seeded."""
    rng = random.Random(1234)
    starts = [[rng.randrange(VOCAB_SIZE) for _ in range(first)] for _ in range(conversations)]
    order = []
    for t in range(num_turns):
        for c in range(conversations):
            msg = starts[c] if t == 0 else [rng.randrange(VOCAB_SIZE) for _ in range(message)]
            order.append((c, msg))
    return order


def run_multi_turn(model: str, offload: str | None, args, plan) -> dict:
    llm = LLM(model, block_size=BLOCK, num_kv_blocks=args.pool_blocks, dtype="float32",
              num_threads=args.threads, offload=offload)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=args.answer, ignore_eos=True)
    history: dict[int, list[int]] = {}
    outputs = []
    tokens = 0
    t0 = time.perf_counter()
    for c, msg in plan:
        prompt = history.get(c, []) + msg
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        answer = out.outputs[0].token_ids
        outputs.append(answer)
        history[c] = prompt + answer
        tokens += len(prompt) + len(answer)
    seconds = time.perf_counter() - t0
    stats = llm.stats()
    llm.shutdown()
    return {"seconds": seconds, "tokens": tokens, "outputs": outputs, **stats}


RESTART_SCRIPT = """
import json, sys, time
from kvserve import LLM, SamplingParams
model, offload, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
prompt = json.loads(sys.argv[4])
llm = LLM(model, block_size=16, dtype="float32", num_threads=threads, num_kv_blocks=1024,
          offload=offload)
t0 = time.perf_counter()
out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
ttft = time.perf_counter() - t0
llm.shutdown()
print(json.dumps({"ttft": ttft, "token": out[0].outputs[0].token_ids,
                  "external": llm.stats()["external_hit_tokens"]}))
"""


def restart(model: str, args) -> tuple[dict, dict]:
    rng = random.Random(99)
    prompt = [rng.randrange(VOCAB_SIZE) for _ in range(args.prefix)]
    with tempfile.TemporaryDirectory() as d:
        offload = f"disk:{d}:4GiB"
        cmd = [sys.executable, "-c", RESTART_SCRIPT, model, offload, str(args.threads)]
        runs = []
        for _ in range(2):
            proc = subprocess.run([*cmd, json.dumps(prompt)], capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"restart run failed:\n{proc.stderr}")
            runs.append(json.loads(proc.stdout.splitlines()[-1]))
    return runs[0], runs[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small smoke run")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--model-dir", help="where the benchmark checkpoint lives")
    args = p.parse_args(argv)
    if args.quick:
        args.conversations, args.turns, args.first, args.message = 4, 2, 128, 32
        args.answer, args.prefix = 8, 512
    else:
        args.conversations, args.turns, args.first, args.message = 8, 3, 384, 64
        args.answer, args.prefix = 16, 2000
    # Distinct KV of all conversations at the end, in blocks; the pool gets a quarter.
    per_conv = args.first + (args.turns - 1) * args.message + args.turns * args.answer
    working_set = args.conversations * -(-per_conv // BLOCK)
    args.pool_blocks = max(working_set // 4, -(-per_conv // BLOCK) + 2)
    model = ensure_checkpoint(args.model_dir)
    print(f"# offload benchmark: {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, torch threads {args.threads}")  # fmt: skip
    print(f"# multi-turn: {args.conversations} conversations x {args.turns} turns, "
          f"working set {working_set} blocks of {BLOCK}, pool {args.pool_blocks} blocks "
          f"({working_set / args.pool_blocks:.1f}x)\n")  # fmt: skip
    plan = turns(args.conversations, args.turns, args.first, args.message, args.answer)
    with tempfile.TemporaryDirectory() as d:
        configs = [
            ("no tier", None),
            ("CPU tier", "cpu:2GiB"),
            ("CPU + disk tiers", f"cpu:2GiB,disk:{d}:4GiB"),
        ]
        results = [(name, run_multi_turn(model, off, args, plan)) for name, off in configs]
    base = results[0][1]
    if any(r["outputs"] != base["outputs"] for _, r in results):
        sys.exit("outputs differ between the configurations: this is a bug")
    print("| configuration | prefill computed | prefix hits | external hits | tokens/s "
          "| prefill vs no tier | tokens/s vs no tier |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, r in results:
        rate = r["tokens"] / r["seconds"]
        print(
            f"| {name} | {r['prefill_tokens_computed']:,} | {r['prefix_hit_tokens']:,} "
            f"| {r['external_hit_tokens']:,} | {rate:,.0f} "
            f"| {r['prefill_tokens_computed'] / base['prefill_tokens_computed']:.2f} "
            f"| {rate / (base['tokens'] / base['seconds']):.2f} |"
        )
    print("\nGreedy outputs identical in all three configurations.\n")
    cold, warm = restart(model, args)
    if cold["token"] != warm["token"]:
        sys.exit("the warm restart gave another token: this is a bug")
    print(f"# restart: one {args.prefix}-token prompt, time to first token in a fresh process\n")
    print("| run | TTFT (s) | external hit tokens | TTFT vs cold |")
    print("|---|---|---|---|")
    print(f"| cold (empty disk tier) | {cold['ttft']:.3f} | {cold['external']} | 1.00 |")
    print(
        f"| warm (disk tier of the cold run) | {warm['ttft']:.3f} | {warm['external']} "
        f"| {warm['ttft'] / cold['ttft']:.2f} |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
