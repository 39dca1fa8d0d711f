"""Weights on 2 MiB pages against 4 KiB pages: one request at a time, in one process.

Run: .venv/bin/python benchmarks/huge_pages.py [--model PATH] [--quantization none|gguf]
         [--dtypes float32 bfloat16] [--rounds 5] [--threads 2] [--prompts 4] [--tokens 32]

Why: decode reads every weight once a step, and each 4 KiB page of them is a TLB miss
(kvserve/model/memory/huge_pages.py). The two engines of a dtype (KVSERVE_HUGE_PAGES=0 and
1) live in this one process and take turns, in opposite orders each round, so a virtual
machine's memory speed, which moves from minute to minute, weighs on both alike. Greedy,
EOS ignored; the table has each engine's median output tok/s, their ratio and whether their
tokens agree. The default model is kvserve's (SmolLM2-135M, float32 from its GGUF file);
`--model ~/.cache/kvserve/llama-1b-random/model-q4_0.gguf --quantization gguf` is
llama_1b.py's 1B model.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from cpu_real import prompts
from machine import machine_line


def main() -> int:
    from kvserve import LLM, SamplingParams
    from kvserve.default_model import default_model_path
    from kvserve.model.memory.huge_pages import ENV, transparent_huge_pages

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(default_model_path()))
    p.add_argument("--quantization", default="none")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32)
    args = p.parse_args()
    requests = prompts(quick=False)[0][: args.prompts]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    made = len(requests) * args.tokens
    print(f"{machine_line(args.threads)}; transparent huge pages: {transparent_huge_pages()}")
    print(f"{Path(args.model).name}, quantization {args.quantization}, {len(requests)} "
          f"chats x {args.tokens} tokens one at a time, {args.rounds} rounds, output tok/s "
          f"(median):")  # fmt: skip
    print(f"{'dtype':<10} {'4 KiB pages':>12} {'2 MiB pages':>12} {'ratio':>7}  same tokens")
    for dtype in args.dtypes:
        engines = {}
        for huge in ("0", "1"):
            os.environ[ENV] = huge  # read when the weights load
            engines[huge] = LLM(args.model, dtype=dtype, quantization=args.quantization,
                                num_threads=args.threads)  # fmt: skip
        os.environ.pop(ENV)
        seconds: dict[str, list[float]] = {"0": [], "1": []}
        tokens: dict[str, list] = {}
        for round_ in range(args.rounds + 1):  # round 0 warms both up
            for huge in ("1", "0") if round_ % 2 else ("0", "1"):
                llm = engines[huge]
                llm.reset_prefix_cache()
                t0 = time.perf_counter()
                outs = [llm.generate([r], params, use_tqdm=False)[0] for r in requests]
                if round_:
                    seconds[huge].append(time.perf_counter() - t0)
                tokens[huge] = [o.outputs[0].token_ids for o in outs]
        rate = {h: made / statistics.median(s) for h, s in seconds.items()}
        same = "yes" if tokens["0"] == tokens["1"] else "NO"
        print(f"{dtype:<10} {rate['0']:>12.2f} {rate['1']:>12.2f} "
              f"{rate['1'] / rate['0']:>6.2f}x  {same}")  # fmt: skip
        for llm in engines.values():
            llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
