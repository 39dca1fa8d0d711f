"""Several engines behind a router (issue 15): routing policies simulated, and live.

Run: .venv/bin/python benchmarks/route.py [--part simulate|live|both]
         simulate: [--replicas 2 4 8] [--policies ...] [--sim-workloads ...]
                   [--mooncake-requests 600] [--pool-scale 1.0]
         live:     [--live-replicas 2] [--conversations 16] [--turns 4]
                   [--model PATH] [--vllm-router PATH]

Progress goes to stderr, the tables (markdown) to stdout, after a machine line.

simulate (route_sim.py): `kvserve.simulate.replicas.simulate_replicas`, the
model-free engines of `kvserve simulate --replicas N`, for round-robin,
least-loaded and cache-aware routing, each beside the single-pool ideal (one
engine with N times the blocks, the report's `single_pool`), on multi-turn,
shared-prefix and the first `--mooncake-requests` requests of the Mooncake
synthetic trace, at 2, 4 and 8 replicas. The pools are sized so that routing
matters: N replicas together hold about what the workload needs (the rule is
in the table's header), so a policy that copies a prefix onto several
replicas evicts, and one that keeps it on one does not. Figures: prefill
tokens computed (and over the single pool's), the hit rate of first
admissions, load balance (max ÷ mean prefill computed per replica), router
predictions the replica contradicted, preemptions and wall seconds of the
routed run.

live (route_live.py): `--live-replicas` `kvserve serve` replicas (the tiny
demo checkpoint unless `--model`), each with KV events and a replay socket
on free loopback ports, behind `kvserve route --policy cache-aware` and
`--policy round-robin`, then (fresh replicas each time) behind vllm-router
with `round_robin` and `cache_aware`. The two round-robins make the same
choices, so what differs between them is the router itself. vllm-router is a
benchmark-only dependency, installed outside the project's venv (see
benchmarks/README.md); without it that part is skipped with a note. It adds
fields of its own to every body, which `kvserve serve` ignores (the report
names them, from the replicas' logs), so it talks to the replicas directly.
The workload is serve_load.py's multi-turn chats, each turn's prompt the
whole history, `--concurrency` chats at once, streamed with
`stream_options.include_usage`. Figures: the sum of every answer's
`usage.prompt_tokens_details.cached_tokens`, TTFT p50 / p99, and each
replica's requests, prompt tokens and prefix-cache hits from its own
/metrics (deltas over the run, warm-up excluded). Ratios: kvserve
cache-aware ÷ vllm-router cache_aware for cached tokens (target ≥ 1.3 at 4
replicas) and for TTFT p99. Last, what kvserve route spent routing each
request before sending it, from its own /metrics histograms: tokenizing
(chat template and tokenizer) and predicting (every replica's view brought
up to date, then matched); p50 / p99 as the histogram bucket they fall in.
"""

from __future__ import annotations

import argparse
import sys

from kvcache_ops import MOONCAKE
from machine import machine_line as machine
from route_live import KVSERVE_CA, VLLM_CA, LiveResult, add_live_args, run_live
from route_sim import POOL_RULE, SimRow, add_sim_args, run_simulate, sim_table
from serve import fmt, ratio, table, version
from serve_targets import note

from kvserve.cli.common import positive


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--part", choices=("simulate", "live", "both"), default="both")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    add_sim_args(p, positive, str(MOONCAKE))
    add_live_args(p, positive)
    args = p.parse_args(argv)
    if args.pool_scale <= 0:
        p.error("--pool-scale must be positive")
    return args


def machine_line() -> str:
    import datetime
    import platform

    return (
        f"{datetime.date.today()}  {machine()}, Python "
        f"{platform.python_version()}, torch {version('torch')}, kvserve {version('kvserve')}"
    )


def print_simulate(args: argparse.Namespace, rows: list[SimRow]) -> None:
    print(f"### simulate ({POOL_RULE.format(block_size=args.block_size)}", end="")
    print(f"; x {args.pool_scale:g})\n" if args.pool_scale != 1 else ")\n")
    header, body = sim_table(rows)
    table(header, body)


def print_live(model: str, args: argparse.Namespace, results: list[LiveResult]) -> None:
    print(
        f"### live: {args.live_replicas} `kvserve serve` replicas, {model}; "
        f"{args.conversations} chats x {args.turns} turns, concurrency {args.concurrency}, "
        f"max_tokens {args.max_tokens} (greedy, ignore_eos), {args.threads} thread(s) each"
        + (
            f"; {args.rounds} rounds, every other one in reverse order: latencies over all "
            "rounds, cached tokens and per-replica figures as means per round"
            if args.rounds > 1
            else ""
        )
        + "\n"
    )
    rows = []
    for r in results:
        s = r.summary
        per = ", ".join(f"{d['requests']:.0f}" for d in r.per_replica)
        hits = ", ".join(f"{d['cached_tokens']:,.0f}" for d in r.per_replica)
        rows.append(
            [
                r.label,
                str(s["requests"]),
                str(s["errors"]),
                f"{r.cached_tokens:,}",
                fmt(s["cached_share"], 100) + ("%" if s["cached_share"] is not None else ""),
                fmt(s["ttft_p50"], 1000),
                fmt(s["ttft_p99"], 1000),
                per,
                hits,
            ]
        )
    header = ["router", "requests", "errors", "cached tokens (usage)", "cached share"]
    header += ["TTFT p50 ms", "TTFT p99 ms", "requests per replica (/metrics)"]
    header += ["prefix-cache hits per replica (/metrics)"]
    table(header, rows)
    by = {r.label: r for r in results}
    ours, theirs = by.get(KVSERVE_CA), by.get(VLLM_CA)
    if ours is not None and theirs is not None:
        target = " (target ≥ 1.3 at 4 replicas)"
        table(
            [f"cached tokens kvserve cache-aware ÷ vllm-router cache_aware{target}", "TTFT p99"],
            [
                [
                    ratio(ours.cached_tokens, theirs.cached_tokens),
                    ratio(ours.summary["ttft_p99"], theirs.summary["ttft_p99"]),
                ]
            ],
        )


def print_stages(results: list[LiveResult]) -> None:
    """What kvserve route spent routing each request before sending it (its own histograms)."""
    ours = [r for r in results if r.stages]
    if not ours:
        return
    header = ["router (its /metrics, every round)"]
    for name in ours[0].stages:
        header += [f"{name} mean ms", f"{name} p50 ≤ ms", f"{name} p99 ≤ ms"]
    rows = []
    for r in ours:
        row = [r.label]
        for s in r.stages.values():
            row += [fmt(s.mean_ms(), digits=2), fmt(s.bound_ms(0.5)), fmt(s.bound_ms(0.99))]
        rows.append(row)
    table(header, rows)


def main() -> int:
    args = parse_args()
    notes: list[str] = []
    sim_rows: list[SimRow] = []
    live: tuple[str, list[LiveResult]] | None = None
    if args.part in ("simulate", "both"):
        sim_rows = run_simulate(args, note)
    if args.part in ("live", "both"):
        live = run_live(args, notes)
    print(machine_line() + "\n")
    if sim_rows:
        print_simulate(args, sim_rows)
    if live is not None:
        print_live(live[0], args, live[1])
        print_stages(live[1])
    for r in live[1] if live else []:
        if r.ignored:
            notes.append(f"{r.label}: the replicas ignored the fields {', '.join(r.ignored)}")
        if r.summary["errors"]:
            notes.append(
                f"{r.label}: {r.summary['errors']} failed, e.g. {r.summary['first_error']}"
            )
    for line in notes:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
