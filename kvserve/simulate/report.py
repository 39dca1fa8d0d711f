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


def format_report(report: dict) -> str:
    title = (
        f"kvserve simulate: {report['workload']}  (groups {','.join(report['groups'])}, "
        f"block size {report['block_size']}, "
        f"prefix caching {'on' if report['prefix_caching'] else 'off'}, hash {report['hash']})"
    )
    width = max(len(label) for _, label, _ in ROWS)
    lines = [title, "-" * len(title)]
    for key, label, fmt in ROWS:
        lines.append(f"{label:<{width}}  {fmt.format(report[key])}")
    ideal = report["ideal_prefill_tokens"]
    if ideal:
        ratio = report["prefill_tokens_computed"] / ideal
        lines.append(f"{'computed / ideal':<{width}}  {ratio:.3f}")
    for error in report.get("errors", []):
        lines.append(f"rejected: {error}")
    return "\n".join(lines)
