"""`kvserve generate`: completions from a local checkpoint, then a summary of the cache."""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

from kvserve.cli.common import HelpFormatter, add_kv_events_linger, positive
from kvserve.cli.engine_options import add_engine_options, engine_args_from

DEMO_SYSTEM = (
    "You are a concise assistant. Answer in one short sentence, and never repeat the "
    "question back to the user. "
)
DEMO_PROMPTS = [
    DEMO_SYSTEM + "What is the capital of France?",
    DEMO_SYSTEM + "Name a prime number larger than ten.",
    DEMO_SYSTEM + "What colour is the sky on a clear day?",
    DEMO_SYSTEM + "What is the capital of France?",
]
"""The demo prompts share a system prompt (and two are identical): the prefix cache shows."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate completions with a local Hugging Face or GGUF checkpoint",
        description=(
            "Generate completions for one or more prompts and print them, then a summary "
            "(requests, prefill and decode tokens/s, prefix hit rate, KV blocks). Without "
            "--model, a small demo checkpoint with random weights is created once under the "
            "user cache directory and used."
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--model",
        help="Hugging Face checkpoint directory, .gguf file, or a directory holding one "
        "(default: the built-in demo model)",
    )
    p.add_argument(
        "--prompt",
        action="append",
        help="a prompt; repeat for several (default: a few demo prompts that share a prefix)",
    )
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=positive, default=32, help="tokens to generate")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    s.add_argument("--top-k", type=int, default=-1, help="keep the k most likely (-1: all)")
    s.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x top prob")
    s.add_argument("--n", type=positive, default=1, help="completions per prompt")
    s.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    s.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    add_engine_options(p.add_argument_group("engine (kvserve.engine.engine_args.EngineArgs)"))
    o = p.add_argument_group("output")
    add_kv_events_linger(o)
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvserve.llm import LLM
    from kvserve.sampling_params import SamplingParams

    model = args.model
    if model is None:
        from kvserve.model.demo import ensure_demo_model

        model = ensure_demo_model()
        print(f"Using the built-in demo model at {model}: its weights are RANDOM, so its")
        print("completions are gibberish. Pass --model PATH to use a real checkpoint.\n")
    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
    )
    llm = LLM(model, **dataclasses.asdict(engine_args_from(args)))
    prompts = args.prompt or DEMO_PROMPTS
    try:
        outputs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
    finally:
        if args.kv_events_config:
            time.sleep(args.kv_events_linger)
        llm.shutdown()
    for output in outputs:
        print(f"prompt: {output.prompt!r}")
        for completion in output.outputs:
            label = f"[{completion.index}] " if len(output.outputs) > 1 else ""
            print(f"  {label}{completion.text!r}  ({completion.finish_reason})")
    print()
    print(f"requests: {len(outputs)}  completions: {len(outputs) * args.n}")
    _print_summary(llm.stats(), args)
    return 0


def _print_summary(stats: dict[str, Any], args: argparse.Namespace) -> None:
    hit_total = (
        stats["prefix_hit_tokens"] + stats["external_hit_tokens"] + stats["prefill_tokens_computed"]
    )
    prefill_s, decode_s = stats["prefill_step_seconds"], stats["decode_step_seconds"]
    print(
        f"prefill: {stats['prefill_tokens_computed']} tokens computed, "
        f"{_rate(stats['prefill_tokens_computed'], prefill_s)}; "
        f"decode: {stats['generated_tokens']} tokens, "
        f"{_rate(stats['decode_tokens_computed'], decode_s)}"
    )
    rate = stats["prefix_hit_tokens"] / hit_total if hit_total else 0.0
    print(f"prefix cache: {stats['prefix_hit_tokens']} hit tokens ({rate:.1%} of prefill)")
    if args.offload:
        print(
            f"offload: {stats['external_hit_tokens']} tokens loaded from the tiers "
            f"({stats['offload_bytes_loaded'] / 2**20:.1f} MiB in "
            f"{stats['offload_load_seconds']:.3f} s), "
            f"{stats['offload_bytes_saved'] / 2**20:.1f} MiB saved"
        )
    print(
        f"KV blocks: peak {stats['peak_blocks_used']} of {stats['num_kv_blocks']} "
        f"(block size {args.block_size}), duplicates {stats['duplicate_blocks_peak']}, "
        f"preemptions {stats['preemptions']}"
    )


def _rate(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:.1f} tok/s" if seconds > 0 else "n/a"
