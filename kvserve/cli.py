"""The `kvserve` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kvserve.kvcache.hashing import DEFAULT_SEED, HASH_FUNCTIONS


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return number


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="run the scheduler and KV cache manager on a workload, without a model",
        description=(
            "Run kvserve's scheduler and KV cache manager with a model-free runner "
            "(prefill costs nothing; each decode step appends a token derived from the "
            "sequence so far, so identical prompts continue identically). Prints hit "
            "tokens, blocks, duplicates, preemptions and the manager's own time."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--workload",
        choices=["identical-burst", "shared-prefix", "multi-turn", "random"],
        default="shared-prefix",
        help="built-in workload (seeded by --seed)",
    )
    src.add_argument(
        "--trace",
        type=Path,
        help="JSONL trace instead of a workload: kvserve lines "
        '{"id","arrival","prompt_token_ids","max_tokens"} or Mooncake lines '
        '{"timestamp","input_length","output_length","hash_ids"}',
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the workload's tokens")
    w = p.add_argument_group("workload parameters (defaults depend on the workload)")
    w.add_argument("--num-requests", type=_positive, help="identical-burst: 8; random: 256")
    w.add_argument("--prompt-len", type=_positive, help="identical-burst: prompt tokens (600)")
    w.add_argument(
        "--output-len",
        type=_positive,
        help="output tokens: identical-burst 16, shared-prefix 64, multi-turn 100",
    )
    w.add_argument("--num-groups", type=_positive, help="shared-prefix: groups (16)")
    w.add_argument(
        "--prompts-per-group", type=_positive, help="shared-prefix: prompts per group (32)"
    )
    w.add_argument("--system-len", type=_positive, help="shared-prefix: system prompt (2048)")
    w.add_argument("--question-len", type=_positive, help="shared-prefix: question (128)")
    w.add_argument("--conversations", type=_positive, help="multi-turn: conversations (64)")
    w.add_argument("--turns", type=_positive, help="multi-turn: turns per conversation (6)")
    w.add_argument("--turn-len", type=_positive, help="multi-turn: new user message (100)")
    w.add_argument("--min-len", type=_positive, help="random: min input/output length (100)")
    w.add_argument("--max-len", type=_positive, help="random: max input/output length (1024)")
    t = p.add_argument_group("trace options")
    t.add_argument(
        "--arrival-unit",
        choices=["steps", "seconds"],
        default="steps",
        help="unit of 'arrival' in kvserve traces (Mooncake timestamps are milliseconds)",
    )
    t.add_argument(
        "--step-seconds",
        type=float,
        default=0.05,
        help="simulated duration of one step, to turn seconds into steps",
    )
    k = p.add_argument_group("KV cache and scheduler")
    k.add_argument("--block-size", type=_positive, default=16, help="tokens per hash block")
    k.add_argument(
        "--model-spec",
        choices=["full", "gemma3-like", "mamba-hybrid-like"],
        default="full",
        help="KV cache groups of the simulated model: full attention only; Gemma 3's "
        "full-attention group plus two sliding-window groups (window 1024); or a Bamba-like "
        "attention group plus three Mamba2 state groups (attention blocks inflated 4x)",
    )
    k.add_argument(
        "--groups",
        help="explicit groups instead of --model-spec, comma separated: "
        "'full', 'sliding:<window>' or 'mamba:<state page in hash blocks>', "
        "e.g. full,sliding:512 or full,mamba:4",
    )
    k.add_argument(
        "--num-blocks",
        type=_positive,
        help="blocks in the pool (default: enough that the workload never evicts)",
    )
    k.add_argument("--max-num-seqs", type=_positive, default=256, help="max running requests")
    k.add_argument(
        "--max-num-batched-tokens",
        type=_positive,
        default=8192,
        help="token budget per step (prompts beyond it are chunked)",
    )
    k.add_argument("--no-prefix-caching", action="store_true", help="compute every prompt token")
    k.add_argument("--hash", choices=sorted(HASH_FUNCTIONS), default="sha256", help="block hash")
    k.add_argument(
        "--hash-seed",
        type=int,
        default=DEFAULT_SEED,
        help="root of the hash chain; equal seeds give equal hashes on every machine",
    )
    k.add_argument(
        "--no-verify-hits",
        action="store_true",
        help="trust hashes without comparing token ids (faster; a collision could hit)",
    )
    _add_kv_events_option(k)
    o = p.add_argument_group("output")
    o.add_argument(
        "--check", action="store_true", help="verify every DESIGN invariant after every step"
    )
    o.add_argument("--json", type=Path, metavar="PATH", help="also write the report as JSON")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_run_simulate)


def _workload(args: argparse.Namespace):
    from kvserve.simulate.traces import load_trace
    from kvserve.simulate.workloads import WORKLOADS

    if args.trace is not None:
        return load_trace(
            args.trace, arrival_unit=args.arrival_unit, step_seconds=args.step_seconds
        )
    options = {
        "identical-burst": {
            "num_requests": args.num_requests,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
        },
        "shared-prefix": {
            "num_groups": args.num_groups,
            "prompts_per_group": args.prompts_per_group,
            "system_len": args.system_len,
            "question_len": args.question_len,
            "output_len": args.output_len,
        },
        "multi-turn": {
            "num_conversations": args.conversations,
            "num_turns": args.turns,
            "turn_len": args.turn_len,
            "output_len": args.output_len,
        },
        "random": {
            "num_requests": args.num_requests,
            "min_len": args.min_len,
            "max_len": args.max_len,
        },
    }[args.workload]
    kwargs = {key: value for key, value in options.items() if value is not None}
    if args.workload == "random":
        lo, hi = kwargs.get("min_len", 100), kwargs.get("max_len", 1024)
        if lo > hi:
            raise ValueError(f"--min-len ({lo}) must not exceed --max-len ({hi})")
    return WORKLOADS[args.workload](seed=args.seed, **kwargs)


def _run_simulate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from kvserve.simulate.report import format_report
    from kvserve.simulate.simulator import MODEL_SPECS, SimConfig, simulate

    workload = _workload(args)
    groups = MODEL_SPECS[args.model_spec]
    if args.groups:
        groups = tuple(part.strip() for part in args.groups.split(",") if part.strip())
        if not groups:
            raise ValueError(f"--groups {args.groups!r} names no group: use e.g. full,sliding:512")
    config = SimConfig(
        groups=groups,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        hash_fn=args.hash,
        hash_seed=args.hash_seed,
        verify_hits=not args.no_verify_hits,
        check=args.check,
        kv_events_config=args.kv_events_config,
        kv_events_linger=args.kv_events_linger,
    )
    with tqdm(
        total=workload.expected_requests,
        desc="requests",
        unit="req",
        disable=True if args.no_progress else None,
        leave=False,
    ) as bar:
        report = simulate(workload, config, progress=bar.update)
    print(format_report(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _bytes(value: str) -> int:
    """'8GiB', '512MiB', '1.5GB', '1000000' -> bytes (kvserve.offload.parse_size)."""
    from kvserve.offload.options import parse_size

    try:
        size = parse_size(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if size <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {value!r}")
    return size


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


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate completions with a local Hugging Face checkpoint",
        description=(
            "Generate completions for one or more prompts and print them, then a summary "
            "(requests, prefill and decode tokens/s, prefix hit rate, KV blocks). Without "
            "--model, a small demo checkpoint with random weights is created once under the "
            "user cache directory and used."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", help="checkpoint directory (default: the built-in demo model)")
    p.add_argument(
        "--prompt",
        action="append",
        help="a prompt; repeat for several (default: a few demo prompts that share a prefix)",
    )
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=_positive, default=32, help="tokens to generate")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    s.add_argument("--top-k", type=int, default=-1, help="keep the k most likely (-1: all)")
    s.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x top prob")
    s.add_argument("--n", type=_positive, default=1, help="completions per prompt")
    s.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    s.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    e = p.add_argument_group("engine")
    e.add_argument("--block-size", type=_positive, default=16, help="tokens per KV block")
    e.add_argument("--num-kv-blocks", type=_positive, help="KV blocks (default: from memory)")
    e.add_argument("--kv-cache-memory", type=_bytes, help="KV cache size, e.g. 2GiB")
    e.add_argument("--max-num-seqs", type=_positive, default=256, help="max running requests")
    e.add_argument(
        "--max-num-batched-tokens", type=_positive, default=8192, help="token budget per step"
    )
    e.add_argument("--max-model-len", type=_positive, help="max prompt + output tokens")
    e.add_argument("--no-prefix-caching", action="store_true", help="compute every prompt token")
    e.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="auto: float32 on the CPU, bfloat16 on CUDA",
    )
    e.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    e.add_argument(
        "--offload",
        metavar="TIERS",
        help="external KV tiers below the pool, e.g. cpu:8GiB,disk:/path/to/dir:50GiB "
        "(either alone); a disk tier persists across runs",
    )
    _add_kv_events_option(e)
    e.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from kvserve.llm import LLM
    from kvserve.sampling_params import SamplingParams

    model = args.model
    if model is None:
        from kvserve.model.demo import ensure_demo_model

        model = ensure_demo_model()
        print(f"Using the built-in demo model at {model}: its weights are RANDOM, so its")
        print("completions are gibberish. Pass --model DIR to use a real checkpoint.\n")
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
    llm = LLM(
        model,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        dtype=args.dtype,
        device=args.device,
        kv_events_config=args.kv_events_config,
        offload=args.offload,
    )
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
    stats = llm.stats()
    hit_total = (
        stats["prefix_hit_tokens"] + stats["external_hit_tokens"] + stats["prefill_tokens_computed"]
    )
    prefill_s, decode_s = stats["prefill_step_seconds"], stats["decode_step_seconds"]
    print()
    print(f"requests: {len(outputs)}  completions: {len(outputs) * args.n}")
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
    return 0


def _add_kv_events_option(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--kv-events-config",
        metavar="JSON",
        help="publish KV cache events, vLLM's keys, e.g. "
        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558"}\' (watch them with `kvserve events`)',
    )
    group.add_argument(
        "--kv-events-linger",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="keep serving KV event replay and snapshots this long after the run",
    )


def _add_events(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "events",
        help="watch an engine's KV cache events",
        description=(
            "Subscribe to an engine's KV cache events, print each one and the size of the "
            "prefix index built from them. Recovers from gaps by replay or a snapshot."
        ),
    )
    p.add_argument("--connect", required=True, help="the engine's PUB endpoint, tcp://host:port")
    p.add_argument(
        "--replay",
        help="the engine's replay endpoint (default: the --connect port + 1)",
    )
    p.add_argument("--topic", default="", help="topic to subscribe to")
    p.add_argument("--duration", type=float, help="stop after this many seconds")
    p.add_argument("--quiet", action="store_true", help="print only the index size")
    p.set_defaults(func=_run_events)


def _run_events(args: argparse.Namespace) -> int:
    from kvserve.events.watch import watch

    replay = args.replay
    if replay is None:
        base, _, port = args.connect.rpartition(":")
        if not port.isdigit():
            raise ValueError(
                f"cannot derive a replay endpoint from {args.connect!r}: pass --replay"
            )
        replay = f"{base}:{int(port) + 1}"
    watch(args.connect, replay, topic=args.topic, duration=args.duration, quiet=args.quiet)
    return 0


def _rate(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:.1f} tok/s" if seconds > 0 else "n/a"


def _add_kv_metadata(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "kv-metadata",
        help="print how an engine on a checkpoint hashes and groups its KV cache (JSON)",
        description=(
            "Print, as JSON, what a consumer of KV cache events needs to hash and match "
            "the way the engine does: per group its kind, physical block size, hash block "
            "size and window, and the hash function and seed. Reads config.json only."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--block-size", type=_positive, default=16, help="tokens per hash block")
    p.add_argument("--hash", choices=sorted(HASH_FUNCTIONS), default="sha256", help="block hash")
    p.add_argument("--hash-seed", type=int, default=DEFAULT_SEED, help="root of the hash chain")
    p.set_defaults(func=_run_kv_metadata)


def _run_kv_metadata(args: argparse.Namespace) -> int:
    import torch

    from kvserve.kvcache.event_metadata import kv_events_metadata
    from kvserve.kvcache.manager import KVCacheConfig, KVCacheManager
    from kvserve.model.config import load_model_config
    from kvserve.model.layer_groups import group_layers
    from kvserve.model.runner import layer_kv_specs

    config = load_model_config(args.model)
    layout = group_layers(layer_kv_specs(config, args.block_size, torch.float32))
    manager = KVCacheManager(
        KVCacheConfig(
            num_blocks=2,
            block_size=args.block_size,
            hash_fn=args.hash,
            hash_seed=args.hash_seed,
            specs=layout.specs,
        )
    )
    print(json.dumps(kv_events_metadata(manager), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvserve",
        description="kvserve: a compact LLM inference engine whose KV cache is exactly right.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate(sub)
    _add_kv_metadata(sub)
    _add_simulate(sub)
    _add_events(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as exc:
        print(f"kvserve {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
