"""The differential fuzzer in CI: a minute of random workloads over every architecture (half
in the exact mode the suite runs, half in the default fast float32 mode, its own
references), and the shrunk workloads of what it found before, replayed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve.engine.engine_args import EXACT_ENV
from tests._shared import shared_dir
from tests.fuzz.campaign import run_campaign
from tests.fuzz.differential import References, run_workload
from tests.fuzz.models import FUZZ_ARCHS, fuzz_checkpoints
from tests.fuzz.workloads import Workload

CI_SECONDS = 30
"""Per mode."""


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, References]:
    """Per dtype (a shrunk workload's "dtype", float32 unless it says), built on first use."""

    class ByDtype(dict[str, References]):
        def __missing__(self, dtype: str) -> References:
            self[dtype] = References(fuzz_checkpoints(shared_dir(tmp_path_factory)), dtype)
            return self[dtype]

    return ByDtype()


SHRUNK = Path(__file__).parent / "shrunk"
"""The minimal workloads of what the fuzzer found (each file says why it is there; the
bfloat16 ones are rounding that the ties must keep out, not faults that were fixed)."""


@pytest.mark.parametrize("name", sorted(p.stem for p in SHRUNK.glob("*.json")))
def test_shrunk_findings_stay_fixed(references: dict[str, References], name: str) -> None:
    saved = json.loads((SHRUNK / f"{name}.json").read_text())
    workload = Workload.from_json(saved)
    findings = run_workload(workload, references[saved.get("dtype", "float32")])
    assert not findings, "\n".join(map(str, findings))


@pytest.mark.slow
@pytest.mark.parametrize("exact", ["1", "0"], ids=["exact", "fast"])
def test_a_minute_of_random_workloads_finds_nothing(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, exact: str
) -> None:
    monkeypatch.setenv(EXACT_ENV, exact)  # each mode against its own lone runs
    references = References(fuzz_checkpoints(shared_dir(tmp_path_factory)))
    campaign = run_campaign(references, FUZZ_ARCHS, CI_SECONDS, seed=int(exact), shrink_seconds=60)
    total = sum(c["workloads"] for c in campaign.counts.values())
    assert total >= len(FUZZ_ARCHS), "every architecture ran at least once"
    assert not campaign.findings, campaign.report()
