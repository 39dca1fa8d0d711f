"""The simulate part of benchmarks/route.py: routing policies over model-free replicas.

Each (workload, replica count) runs every policy through `simulate_replicas`,
which also runs the same workload on one engine of N times the blocks (the
report's `single_pool`, the ideal the routed replicas are measured against).
"""

from __future__ import annotations

import argparse
import math
import tempfile
from dataclasses import dataclass
from itertools import islice
from typing import Any

from kvserve.simulate.replicas import simulate_replicas
from kvserve.simulate.simulator import SimConfig
from kvserve.simulate.traces import load_trace
from kvserve.simulate.workloads import Workload, multi_turn, shared_prefix

POLICIES = ("round-robin", "least-loaded", "cache-aware")
SIM_WORKLOADS = ("multi-turn", "shared-prefix", "mooncake")
POOL_RULE = (
    "blocks per replica = ⌈needed ÷ N⌉, needed = the workload's distinct blocks "
    "(prompts and outputs, block size {block_size}): N replicas together hold what one "
    "pool needs to never evict, the single pool holds exactly that"
)


@dataclass(slots=True)
class SimRow:
    workload: str
    replicas: int
    num_blocks: int
    report: dict[str, Any]
    """The first policy's report (its `single_pool` is every policy's)."""
    by_policy: dict[str, dict[str, Any]]
    """One `simulate_replicas` report per policy."""


def build_workloads(args: argparse.Namespace) -> list[Workload]:
    out = []
    for name in args.sim_workloads:
        if name == "multi-turn":
            out.append(
                multi_turn(
                    seed=args.seed,
                    num_conversations=args.sim_conversations,
                    num_turns=args.sim_turns,
                    output_spread=args.sim_output_spread,
                )
            )
        elif name == "shared-prefix":
            out.append(
                shared_prefix(
                    seed=args.seed,
                    num_groups=args.sim_groups,
                    prompts_per_group=args.sim_prompts_per_group,
                )
            )
        else:
            out.append(mooncake(args.trace, args.mooncake_requests))
    return out


def mooncake(path: str, requests: int) -> Workload:
    """The trace's first `requests` requests (in arrival order), through simulate's reader."""
    with open(path) as f, tempfile.NamedTemporaryFile("w", suffix=".jsonl") as head:
        head.writelines(islice(f, requests))
        head.flush()
        workload = load_trace(head.name)
    workload.name = f"mooncake (first {len(workload.requests)})"
    return workload


def needed_blocks(workload: Workload, block_size: int) -> int:
    """Distinct blocks of all the workload's tokens: shared prompt blocks count once.

    Multi-turn's follow-ups are not known up front; each chat's last turn holds all of
    its tokens, so a chat needs ⌈turns x (message + answer) ÷ block size⌉ blocks.
    """
    p = workload.params
    if workload.name == "multi-turn":
        chat = p["num_turns"] * (p["turn_len"] + p["output_len"])
        return p["num_conversations"] * math.ceil(chat / block_size)
    seen: set[int] = set()
    tails = 0
    for r in workload.requests:
        tokens = r.prompt_token_ids
        full = len(tokens) // block_size
        parent = 0
        for b in range(full):
            parent = hash((parent, tuple(tokens[b * block_size : (b + 1) * block_size])))
            seen.add(parent)
        # The partial last prompt block and the answer: this request's own.
        tails += math.ceil((len(tokens) - full * block_size + r.max_tokens) / block_size)
    return len(seen) + tails


def run_simulate(args: argparse.Namespace, note: Any) -> list[SimRow]:
    rows = []
    for workload in build_workloads(args):
        need = needed_blocks(workload, args.block_size)
        for n in args.replicas:
            blocks = math.ceil(need * args.pool_scale / n)
            config = SimConfig(block_size=args.block_size, num_blocks=blocks)
            by_policy = {}
            for policy in args.policies:
                note(f"simulate: {workload.name}, {n} replicas x {blocks} blocks, {policy}")
                by_policy[policy] = simulate_replicas(workload, config, n, policy)
            report = next(iter(by_policy.values()))
            rows.append(SimRow(workload.name, n, blocks, report, by_policy))
    return rows


def sim_table(rows: list[SimRow]) -> tuple[list[str], list[list[str]]]:
    """The header and rows of the simulate table."""
    header = [
        "workload",
        "replicas",
        "blocks / replica",
        "policy",
        "prefill tokens computed",
        "÷ single pool",
        "hit rate",
        "load balance (max ÷ mean)",
        "predictions wrong",
        "preemptions",
        "wall s",
    ]
    out = []
    for row in rows:
        single = row.report["single_pool"]
        out.append(
            [
                row.workload,
                str(row.replicas),
                f"{single['num_blocks']:,} (one pool)",
                "single_pool",
                f"{single['prefill_tokens_computed']:,}",
                "1.00",
                f"{single['hit_rate']:.1%}",
                "-",
                "-",
                str(single["preemptions"]),
                "-",
            ]
        )
        for policy, r in row.by_policy.items():
            out.append(
                [
                    row.workload,
                    str(row.replicas),
                    f"{row.num_blocks:,}",
                    policy,
                    f"{r['prefill_tokens_computed']:,}",
                    f"{r['prefill_vs_single_pool']:.2f}",
                    f"{r['hit_rate']:.1%}",
                    f"{r['load_balance']:.2f}",
                    str(r["predictions_wrong"]),
                    str(r["preemptions"]),
                    f"{r['wall_seconds']:.1f}",
                ]
            )
    return header, out


def add_sim_args(p: argparse.ArgumentParser, positive: Any, trace: str) -> None:
    g = p.add_argument_group("simulate part")
    g.add_argument("--sim-workloads", nargs="+", choices=SIM_WORKLOADS, default=list(SIM_WORKLOADS))
    g.add_argument("--replicas", nargs="+", type=positive, default=[2, 4, 8])
    g.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    g.add_argument("--block-size", type=positive, default=16)
    g.add_argument(
        "--pool-scale",
        type=float,
        default=1.0,
        help="blocks per replica = ⌈needed x scale ÷ N⌉ (below 1: memory pressure on one pool too)",
    )
    g.add_argument("--sim-conversations", type=positive, default=64, help="multi-turn chats")
    g.add_argument("--sim-turns", type=positive, default=6, help="multi-turn: turns per chat")
    g.add_argument(
        "--sim-output-spread",
        type=int,
        default=50,
        help="multi-turn: answers are 100 ± this many tokens, so chats drift out of step "
        "(0: all turns arrive together, in one order, and round-robin keeps every chat in place)",
    )
    g.add_argument("--sim-groups", type=positive, default=16, help="shared-prefix: groups")
    g.add_argument(
        "--sim-prompts-per-group", type=positive, default=32, help="shared-prefix: prompts"
    )
    g.add_argument("--trace", default=trace, help="the Mooncake JSONL trace")
    g.add_argument(
        "--mooncake-requests", type=positive, default=600, help="the trace's first N requests"
    )
