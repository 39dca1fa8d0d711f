"""The differential fuzzer's long run: every request of a busy engine against itself alone.

Run: .venv/bin/python benchmarks/fuzz.py [--minutes 60] [--seed 0] [--archs a,b]
         [--dtype float32|bfloat16]
     .venv/bin/python benchmarks/fuzz.py --replay fuzz-findings.json
     .venv/bin/python benchmarks/fuzz.py --replay tests/fuzz/shrunk/NAME.json

Random workloads (tests/fuzz/workloads.py) over tiny checkpoints of every
architecture kvserve runs (built by the test suite's own builders, in a
temporary folder or `--checkpoints DIR`): chunked prefill, preemption on
small pools, n > 1, seeded sampling, aborts, the CPU and disk tiers, prompt
lookup and draft-model speculation. Each finished request must equal the
same request alone with prefix caching off (greedy float32, or its own
seed); the KV cache's invariants are checked after every step. Findings
(mismatch, hang, leak, duplicate, invariant, error) are shrunk to a minimal
workload, printed, and written to `--out` as JSON for `--replay`. The table
says what was exercised per architecture. Engines run the default (fast) float32
matmuls; `KVSERVE_EXACT=1` fuzzes the exact mode; `--dtype bfloat16` the bfloat16 engines
(kvserve's AVX-512 BF16 kernels where the CPU has them) with a wider tie and the other
rows' kernels as a second reference (tests/fuzz/differential.py's TIE_BFLOAT16), over the
architectures without experts unless named (tests/fuzz/models.py's BFLOAT16_ARCHS).
Packed weights (`--archs llama-int4,qwen2-int8`) run by name only, with a wider tie
(tests/fuzz/models.py says why).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("KVSERVE_EXACT", "0")  # before tests.conftest makes the suite's exact default

COLUMNS = [
    ("workloads", "workloads"),
    ("requests", "requests"),
    ("refused", "refused"),
    ("completions", "compared"),
    ("tokens", "tokens"),
    ("preemptions", "preempt"),
    ("prefix_hit_tokens", "hit tok"),
    ("external_hit_tokens", "tier tok"),
    ("spec_draft_tokens", "drafts"),
    ("ties", "ties"),
]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=60.0, help="how long to fuzz (default 60)")
    p.add_argument("--seed", type=int, default=0, help="the campaign's seed (default 0)")
    p.add_argument("--archs", default="",
                   help="comma-separated architectures (default all; packed weights, "
                        "llama-int4 and qwen2-int8, only by name)")  # fmt: skip
    p.add_argument("--shrink-seconds", type=float, default=300.0,
                   help="time to shrink each finding (default 300)")  # fmt: skip
    p.add_argument("--checkpoints", type=Path, help="where the tiny checkpoints are (built)")
    p.add_argument("--out", type=Path, default=Path("fuzz-findings.json"),
                   help="findings with their minimal workloads (written only if any)")  # fmt: skip
    p.add_argument("--replay", type=Path, help="run the workloads of a findings file again")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="the engines' dtype (bfloat16: its fast kernels, a wider tie, no "
                        "experts unless named; give a replay the campaign's)")  # fmt: skip
    args = p.parse_args(argv)
    if args.minutes <= 0:
        p.error("--minutes must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from machine import machine_line
    from tqdm import tqdm

    from tests.fuzz.campaign import run_campaign
    from tests.fuzz.differential import References, run_workload
    from tests.fuzz.models import BFLOAT16_ARCHS, FUZZ_ARCHS, QUANTIZED_ARCHS, fuzz_checkpoints
    from tests.fuzz.workloads import Workload

    default = BFLOAT16_ARCHS if args.dtype == "bfloat16" else FUZZ_ARCHS
    archs = [a for a in args.archs.split(",") if a] or default
    known = [*FUZZ_ARCHS, *QUANTIZED_ARCHS]
    unknown = sorted(set(archs) - set(known))
    if unknown:
        sys.exit(f"unknown architectures {unknown}: choose from {', '.join(known)}")
    with tempfile.TemporaryDirectory(prefix="kvserve-fuzz-models-") as tmp:
        root = args.checkpoints or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        if args.replay:
            saved = json.loads(args.replay.read_text())  # findings, or one shrunk workload
            rows = saved if isinstance(saved, list) else [{"workload": saved}]
            workloads = [Workload.from_json(f["workload"]) for f in rows]
            dtype = saved.get("dtype", args.dtype) if isinstance(saved, dict) else args.dtype
            refs = References(fuzz_checkpoints(root, sorted({w.arch for w in workloads})),
                              dtype)  # fmt: skip
            for w in workloads:
                findings = run_workload(w, refs)
                print(f"{w.arch}: " + ("; ".join(map(str, findings)) or "no finding"))
            return 0
        refs = References(fuzz_checkpoints(root, archs), args.dtype)
        header = (
            f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC  {machine_line()}, Python "
            f"{platform.python_version()}; seed {args.seed}, {args.minutes:g} minutes, "
            f"{args.dtype}"
        )
        print(header, flush=True)
        bar = tqdm(total=int(args.minutes * 60), unit="s", desc="fuzzing", file=sys.stderr,
                   mininterval=5)  # fmt: skip
        t0 = time.monotonic()
        shown = 0

        def progress(campaign) -> None:
            nonlocal shown
            for finding, small in campaign.findings[shown:]:  # as they come, shrunk
                bar.write(f"{finding}\n  minimal workload: {json.dumps(small.to_json())}")
            shown = len(campaign.findings)
            done = sum(c["workloads"] for c in campaign.counts.values())
            bar.set_postfix(workloads=done, findings=len(campaign.findings), refresh=False)
            bar.update(min(bar.total, int(time.monotonic() - t0)) - bar.n)

        campaign = run_campaign(
            refs, archs, args.minutes * 60, args.seed, args.shrink_seconds, progress
        )
        bar.close()
    print(f"\n{'arch':<16}" + "".join(f"{title:>11}" for _, title in COLUMNS) + f"{'findings':>10}")
    found = {a: sum(f.workload.arch == a for f, _ in campaign.findings) for a in archs}
    for arch in archs:
        counts = campaign.counts[arch]
        cells = "".join(f"{counts[key]:>11,}" for key, _ in COLUMNS)
        print(f"{arch:<16}{cells}{found[arch]:>10}")
    total = {key: sum(c[key] for c in campaign.counts.values()) for key, _ in COLUMNS}
    print(f"{'all':<16}" + "".join(f"{total[k]:>11,}" for k, _ in COLUMNS)
          + f"{len(campaign.findings):>10}")  # fmt: skip
    print(f"\n{campaign.seconds / 60:.1f} minutes; {len(campaign.findings)} findings")
    if campaign.findings:
        print(campaign.report())
        rows = [{"finding": str(f), "workload": small.to_json()} for f, small in campaign.findings]
        args.out.write_text(json.dumps(rows, indent=1))
        print(f"written to {args.out} (replay: benchmarks/fuzz.py --replay {args.out})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
