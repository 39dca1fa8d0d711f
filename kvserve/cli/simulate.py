"""`kvserve simulate`: the scheduler and KV cache manager on a workload, without a model.

Its options are its own, not `EngineArgs`: it builds no model (see kvserve.simulate)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from kvserve.cli.common import HelpFormatter, add_kv_events_linger, positive
from kvserve.cli.engine_options import field_help
from kvserve.kvcache.hashing import DEFAULT_SEED, HASH_FUNCTIONS
from kvserve.routing import POLICIES


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="run the scheduler and KV cache manager on a workload, without a model",
        description=(
            "Run kvserve's scheduler and KV cache manager with a model-free runner "
            "(prefill costs nothing; each decode step appends a token derived from the "
            "sequence so far, so identical prompts continue identically). Prints hit "
            "tokens, blocks, duplicates, preemptions and the manager's own time."
        ),
        formatter_class=HelpFormatter,
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
    w.add_argument("--num-requests", type=positive, help="identical-burst: 8; random: 256")
    w.add_argument("--prompt-len", type=positive, help="identical-burst: prompt tokens (600)")
    w.add_argument(
        "--output-len",
        type=positive,
        help="output tokens: identical-burst 16, shared-prefix 64, multi-turn 100",
    )
    w.add_argument("--num-groups", type=positive, help="shared-prefix: groups (16)")
    w.add_argument(
        "--prompts-per-group", type=positive, help="shared-prefix: prompts per group (32)"
    )
    w.add_argument("--system-len", type=positive, help="shared-prefix: system prompt (2048)")
    w.add_argument("--question-len", type=positive, help="shared-prefix: question (128)")
    w.add_argument("--conversations", type=positive, help="multi-turn: conversations (64)")
    w.add_argument("--turns", type=positive, help="multi-turn: turns per conversation (6)")
    w.add_argument("--turn-len", type=positive, help="multi-turn: new user message (100)")
    w.add_argument("--min-len", type=positive, help="random: min input/output length (100)")
    w.add_argument("--max-len", type=positive, help="random: max input/output length (1024)")
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
    k.add_argument("--block-size", type=positive, default=16, help="tokens per hash block")
    k.add_argument(
        "--model-spec",
        choices=["full", "gemma3-like", "mamba-hybrid-like"],
        help="KV cache groups of the simulated model: full attention only (the default); "
        "Gemma 3's full-attention group plus two sliding-window groups (window 1024); or a "
        "Bamba-like attention group plus three Mamba2 state groups (attention blocks "
        "inflated 4x)",
    )
    k.add_argument(
        "--groups",
        help="explicit groups instead of --model-spec (not with it), comma separated: "
        "'full', 'sliding:<window>' or 'mamba:<state page in hash blocks>', "
        "e.g. full,sliding:512 or full,mamba:4",
    )
    k.add_argument(
        "--num-blocks",
        type=positive,
        help="blocks in the pool (default: enough that the workload never evicts)",
    )
    k.add_argument("--max-num-seqs", type=positive, default=256, help="max running requests")
    k.add_argument(
        "--max-num-batched-tokens",
        type=positive,
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
    k.add_argument("--kv-events-config", metavar="JSON", help=field_help("kv_events_config"))
    add_kv_events_linger(k)
    x = p.add_argument_group("external KV tiers")
    x.add_argument(
        "--offload",
        metavar="SPEC",
        help="tiers below the pool, as the engine's --offload: cpu:<size>, disk:<dir>:<size> "
        "or both, sizes in bytes of --kv-bytes-per-token per token; the runner keeps each "
        "position's token id as its K/V and checks what the tiers load (default: off)",
    )
    x.add_argument(
        "--kv-bytes-per-token",
        type=positive,
        default=4,
        help="with --offload: bytes of one token's K/V in each group (4: the token id; "
        "131072 is Llama-3-8B in bf16, and the tiers then hold that much, in memory and on "
        "disk)",
    )
    r = p.add_argument_group("several engines")
    r.add_argument(
        "--replicas",
        type=positive,
        default=1,
        help="engines, each with its own scheduler and pool of --num-blocks, behind a router "
        "that knows what each holds from its KV events; the report adds one pool of "
        "replicas x --num-blocks for comparison",
    )
    r.add_argument(
        "--routing",
        choices=list(POLICIES),
        default="cache-aware",
        help="with --replicas > 1: round-robin; least-loaded (fewest queued prefill tokens, "
        "then fewest running); cache-aware (least prefill to compute, queue included, "
        "with a guard against piling on one replica)",
    )
    o = p.add_argument_group("output")
    o.add_argument(
        "--check",
        action="store_true",
        help="verify every design.md invariant after every step (the report says they held)",
    )
    o.add_argument("--json", type=Path, metavar="PATH", help="also write the report as JSON")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


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


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from kvserve.simulate.replicas import simulate_replicas
    from kvserve.simulate.report import format_replicas_report, format_report
    from kvserve.simulate.simulator import MODEL_SPECS, SimConfig, simulate

    if args.model_spec is not None and args.groups is not None:
        raise ValueError("--model-spec and --groups both give the KV cache groups: pass one")
    if args.json is not None:
        _check_writable(args.json, "--json")
    if args.replicas > 1 and args.kv_events_config:
        raise ValueError("--kv-events-config publishes one engine's events: use --replicas 1")
    if args.replicas > 1 and args.offload:
        raise ValueError("--offload: the router predicts device-pool hits only: use --replicas 1")
    workload = _workload(args)
    groups = MODEL_SPECS[args.model_spec or "full"]
    if args.groups is not None:
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
        offload=args.offload,
        kv_bytes_per_token=args.kv_bytes_per_token,
    )
    with tqdm(
        total=workload.expected_requests,
        desc="requests",
        unit="req",
        disable=True if args.no_progress else None,
        leave=False,
    ) as bar:
        if args.replicas > 1:
            report = simulate_replicas(
                workload, config, args.replicas, args.routing, progress=bar.update
            )
        else:
            report = simulate(workload, config, progress=bar.update)
    print(format_replicas_report(report) if args.replicas > 1 else format_report(report))
    if args.check:
        print(f"checks: every invariant held after each of the {report['steps']:,} steps")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _check_writable(path: Path, flag: str) -> None:
    """Fail before the run, not after it, when the report could not be written."""
    if path.is_dir():
        raise ValueError(f"{flag} {path}: is a directory")
    if not path.parent.is_dir():
        raise ValueError(f"{flag} {path}: {path.parent} is not a directory")
    if not os.access(path if path.exists() else path.parent, os.W_OK):
        raise ValueError(f"{flag} {path}: not writable")
