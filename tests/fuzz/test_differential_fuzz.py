"""The differential fuzzer in CI: a minute of random workloads over every architecture,
and the shrunk workloads of what it found before, replayed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._shared import shared_dir
from tests.fuzz.campaign import run_campaign
from tests.fuzz.differential import References, run_workload
from tests.fuzz.models import FUZZ_ARCHS, fuzz_checkpoints
from tests.fuzz.workloads import Workload

CI_SECONDS = 60


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> References:
    return References(fuzz_checkpoints(shared_dir(tmp_path_factory)))


SHRUNK = Path(__file__).parent / "shrunk"
"""The minimal workloads of what the fuzzer found (each file says why it is there)."""


@pytest.mark.parametrize("name", sorted(p.stem for p in SHRUNK.glob("*.json")))
def test_shrunk_findings_stay_fixed(references: References, name: str) -> None:
    workload = Workload.from_json(json.loads((SHRUNK / f"{name}.json").read_text()))
    findings = run_workload(workload, references)
    assert not findings, "\n".join(map(str, findings))


@pytest.mark.slow
def test_a_minute_of_random_workloads_finds_nothing(references: References) -> None:
    campaign = run_campaign(references, FUZZ_ARCHS, CI_SECONDS, seed=0, shrink_seconds=60)
    total = sum(c["workloads"] for c in campaign.counts.values())
    assert total >= len(FUZZ_ARCHS), "every architecture ran at least once"
    assert not campaign.findings, campaign.report()
