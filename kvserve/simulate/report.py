"""The human-readable table of a simulation report."""

from __future__ import annotations

ROWS = [
    ("requests", "requests", "{:,}"),
    ("rejected", "rejected (never fit)", "{:,}"),
    ("prompt_tokens", "prompt tokens", "{:,}"),
    ("ideal_prefill_tokens", "ideal prefill tokens", "{:,}"),
    ("prefill_tokens_computed", "prefill tokens computed", "{:,}"),
    ("prefix_hit_tokens", "prefix hit tokens", "{:,}"),
    ("hit_rate", "hit rate", "{:.1%}"),
    ("generated_tokens", "generated tokens", "{:,}"),
    ("steps", "steps", "{:,}"),
    ("num_blocks", "pool blocks", "{:,}"),
    ("peak_blocks_used", "peak blocks used", "{:,}"),
    ("duplicate_blocks_peak", "duplicate blocks (peak)", "{:,}"),
    ("evictions", "evictions", "{:,}"),
    ("preemptions", "preemptions", "{:,}"),
    ("manager_seconds", "manager time (s)", "{:.4f}"),
    ("manager_us_per_prompt_token", "manager µs / prompt token", "{:.3f}"),
    ("wall_seconds", "wall time (s)", "{:.3f}"),
]


OFFLOAD_ROWS = [
    ("external_hit_tokens", "external hit tokens (tiers)", "{:,}"),
    ("offload_bytes_loaded", "bytes loaded from tiers", "{:,}"),
    ("offload_bytes_saved", "bytes saved to tiers", "{:,}"),
    ("offload_dropped_writes", "tier writes dropped", "{:,}"),
    ("kv_positions_checked", "K/V positions checked", "{:,}"),
]
"""Rows of a run with external tiers (`--offload`)."""


def format_report(report: dict) -> str:
    offload = report.get("offload")
    tiers = f", offload {offload} at {report['kv_bytes_per_token']} B/token" if offload else ""
    title = (
        f"kvserve simulate: {report['workload']}  (groups {','.join(report['groups'])}, "
        f"block size {report['block_size']}, "
        f"prefix caching {'on' if report['prefix_caching'] else 'off'}, hash {report['hash']}"
        f"{tiers})"
    )
    rows = ROWS + OFFLOAD_ROWS if offload else ROWS
    width = max(len(label) for _, label, _ in rows)
    lines = [title, "-" * len(title)]
    for key, label, fmt in rows:
        lines.append(f"{label:<{width}}  {fmt.format(report[key])}")
    ideal = report["ideal_prefill_tokens"]
    if ideal:
        ratio = report["prefill_tokens_computed"] / ideal
        lines.append(f"{'computed / ideal':<{width}}  {ratio:.3f}")
    for error in report.get("errors", []):
        lines.append(f"rejected: {error}")
    return "\n".join(lines)


REPLICA_ROWS = [
    ("requests", "requests", "{:,}"),
    ("prompt_tokens", "prompt tokens", "{:,}"),
    ("prefill_tokens_computed", "prefill tokens computed", "{:,}"),
    ("prefix_hit_tokens", "hit tokens (first admission)", "{:,}"),
    ("hit_rate", "hit rate (first admission)", "{:.1%}"),
    ("readmission_hit_tokens", "hit tokens (re-admissions)", "{:,}"),
    ("preemptions", "preemptions", "{:,}"),
    ("evictions", "evictions", "{:,}"),
    ("peak_blocks_used", "peak blocks used", "{:,}"),
    ("predictions_exact", "predicted hits exact", "{:,}"),
    ("predictions_wrong", "predicted hits wrong", "{:,}"),
]


def format_replicas_report(report: dict) -> str:
    """Per replica and in total, then the routing's numbers and the single pool beside them."""
    n = report["replicas"]
    title = (
        f"kvserve simulate: {report['workload']} on {n} replicas, routing {report['routing']}  "
        f"(groups {','.join(report['groups'])}, block size {report['block_size']}, "
        f"{report['num_blocks']:,} blocks each, hash {report['hash']})"
    )
    heads = [f"replica {i}" for i in range(n)] + ["total"]
    width = max(len(label) for _, label, _ in REPLICA_ROWS)
    columns = [*report["per_replica"], report]
    cells = {key: [fmt.format(r[key]) for r in columns] for key, _, fmt in REPLICA_ROWS}
    col = max(len(h) for h in heads)
    col = max(col, *(len(c) for row in cells.values() for c in row))
    lines = [title, "-" * len(title), " " * width + "".join(f"  {h:>{col}}" for h in heads)]
    for key, label, _ in REPLICA_ROWS:
        lines.append(f"{label:<{width}}" + "".join(f"  {c:>{col}}" for c in cells[key]))
    single = report["single_pool"]
    summary = [
        ("load balance (max / mean prefill)", f"{report['load_balance']:.3f}"),
        ("requests held for a prefix in flight", f"{report['held_requests']:,}"),
        ("rejected (never fit)", f"{report['rejected']:,}"),
        ("generated tokens", f"{report['generated_tokens']:,}"),
        ("steps", f"{report['steps']:,}"),
        (
            f"one pool of {single['num_blocks']:,} blocks",
            f"{single['prefill_tokens_computed']:,} prefill tokens computed, "
            f"hit rate {single['hit_rate']:.1%}, {single['preemptions']:,} preemptions",
        ),
        ("computed / one pool", f"{report['prefill_vs_single_pool']:.3f}"),
    ]
    width = max(len(label) for label, _ in summary)
    lines.append("-" * len(title))
    lines.extend(f"{label:<{width}}  {value}" for label, value in summary)
    lines.extend(f"rejected: {error}" for error in report.get("errors", []))
    return "\n".join(lines)
