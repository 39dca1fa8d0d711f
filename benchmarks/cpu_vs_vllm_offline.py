"""cpu_vs_vllm.py's offline worker: one engine, one dtype, every offline mode, in this process.

Run by cpu_vs_vllm.py, under the project's interpreter for kvserve and under
vLLM's own virtual environment for vLLM (so this file imports nothing but the
standard library at the top, and each engine only inside its branch). The
workload (token ids) comes as a JSON file that the driver wrote with
kvserve's tokenizer, so both engines get exactly the same prompts. Prints
one JSON line: seconds of wall time per repeat of each mode, the load time,
the first request's output tokens (the driver checks the engines agree), and
this process's CPU time.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from collections.abc import Callable
from typing import Any


def kvserve_engine(model: str, dtype: str, threads: int) -> tuple[Callable, Callable]:
    """(generate(prompts, max_tokens) -> first output's token ids, reset_prefix_cache)."""
    from kvserve import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, num_threads=threads)

    def generate(prompts: list[list[int]], max_tokens: int) -> list[int]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return list(outs[0].outputs[0].token_ids)

    return generate, llm.reset_prefix_cache


def vllm_engine(
    model: str, dtype: str, threads: int, eager: bool = False
) -> tuple[Callable, Callable]:
    """The same two calls on vLLM's offline LLM (its CPU build; threads are bound by the
    VLLM_CPU_OMP_THREADS_BIND the driver sets)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, max_model_len=2048, seed=0, enforce_eager=eager)

    def generate(prompts: list[list[int]], max_tokens: int) -> list[int]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        inputs: Any = [{"prompt_token_ids": p} for p in prompts]
        outs = llm.generate(inputs, params, use_tqdm=False)
        return list(outs[0].outputs[0].token_ids)

    return generate, llm.reset_prefix_cache


def timed(run: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["kvserve", "vllm"], required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--workload", required=True, help="the driver's JSON file")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--eager", action="store_true", help="vLLM: enforce_eager")
    args = parser.parse_args()
    with open(args.workload) as f:
        work = json.load(f)
    new = work["max_tokens"]
    t0 = time.perf_counter()
    if args.engine == "kvserve":
        generate, reset = kvserve_engine(args.model, args.dtype, args.threads)
    else:
        generate, reset = vllm_engine(args.model, args.dtype, args.threads, args.eager)
    load = time.perf_counter() - t0
    result: dict[str, Any] = {"load_s": load, "modes": {}}
    tokens = generate(work["batched"][0], new)  # warm-up, not timed
    result["first_tokens"] = tokens
    batches = {f"batched {len(p)}": p for p in work["batched"]}
    for mode, prompts in batches.items():
        seconds = []
        for _ in range(args.repeat):
            reset()
            seconds.append(timed(lambda p=prompts: generate(p, new)))
        result["modes"][mode] = {"seconds": seconds, "tokens": len(prompts) * new}
    one = work["one_at_a_time"]
    seconds = []
    for _ in range(args.repeat if one else 0):
        reset()
        seconds.append(timed(lambda: [generate([p], new) for p in one]))
    if one:
        result["modes"]["one at a time"] = {"seconds": seconds, "tokens": len(one) * new}
    cold, warm = [], []
    for _ in range(args.repeat if "long" in work else 0):  # a long prompt to one token: a
        reset()
        cold.append(timed(lambda: generate([work["long"]], 1)))
        warm.append(timed(lambda: generate([work["long"]], 1)))
    if cold:  # prefill, uncached then cached
        result["modes"]["TTFT cold"] = {"seconds": cold, "tokens": 1}
        result["modes"]["TTFT warm"] = {"seconds": warm, "tokens": 1}
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result["cpu_s"] = usage.ru_utime + usage.ru_stime
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
