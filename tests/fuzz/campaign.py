"""A fuzzing campaign: random workloads over every architecture until the time is up.

The CI test (test_differential_fuzz.py) runs one for a minute, `benchmarks/fuzz.py` for an
hour by default; both start from a seed, so a campaign's workloads are the
same sequence on every machine (a faster machine only gets further). Each
finding is shrunk (shrink.py) and kept with its minimal workload.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from tests.fuzz.differential import Finding, References, run_workload
from tests.fuzz.shrink import shrink
from tests.fuzz.workloads import Workload, random_workload

MAX_FINDINGS = 5
"""A campaign stops after this many findings: each is shrunk, which takes time."""


@dataclass
class Campaign:
    counts: dict[str, Counter[str]] = field(default_factory=dict)
    """Per architecture: workloads, requests, completions and tokens compared, ..."""
    findings: list[tuple[Finding, Workload]] = field(default_factory=list)
    """Each finding with its shrunk workload."""
    seconds: float = 0.0

    def report(self) -> str:
        """Every finding and its minimal workload (JSON), one after the other."""
        import json

        return "\n".join(
            f"{finding}\n  minimal workload: {json.dumps(small.to_json())}"
            for finding, small in self.findings
        )


def run_campaign(
    references: References,
    archs: list[str],
    seconds: float,
    seed: int = 0,
    shrink_seconds: float = 120.0,
    on_workload: Callable[[Campaign], None] | None = None,
) -> Campaign:
    """Random workloads, round-robin over `archs`, for `seconds` (shrinking excluded)."""
    rng = random.Random(seed)
    campaign = Campaign({arch: Counter() for arch in archs})
    start = time.monotonic()
    spent_shrinking = 0.0
    n = 0
    while time.monotonic() - start - spent_shrinking < seconds:
        arch = archs[n % len(archs)]
        n += 1
        workload = random_workload(rng, arch, references.num_groups(arch))
        counts = campaign.counts[arch]
        findings = run_workload(workload, references, counts=counts)
        counts["workloads"] += 1
        counts["requests"] += len(workload.requests)
        for finding in findings[:1]:  # the first one; the shrunk run shows the rest
            t0 = time.monotonic()
            small = shrink(workload, finding.kind, references, shrink_seconds)
            spent_shrinking += time.monotonic() - t0
            campaign.findings.append((finding, small))
        if on_workload is not None:
            on_workload(campaign)
        if len(campaign.findings) >= MAX_FINDINGS:
            break
    campaign.seconds = time.monotonic() - start
    return campaign
