"""The differential fuzzer in CI: a minute of random workloads over every architecture,
and the shrunk workloads of what it found before, replayed."""

from __future__ import annotations

import pytest

from tests._shared import shared_dir
from tests.fuzz.campaign import run_campaign
from tests.fuzz.differential import References, run_workload
from tests.fuzz.models import FUZZ_ARCHS, fuzz_checkpoints
from tests.fuzz.workloads import FuzzRequest, Workload

CI_SECONDS = 60


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> References:
    return References(fuzz_checkpoints(shared_dir(tmp_path_factory)))


SHRUNK = {
    # Gemma 3 (one full and two sliding groups), the disk tier, a small pool: four seeded
    # completions of one prompt preempt each other; one readmitted with its prefix in the
    # tier waited for ever on an idle pool (each window took a block per tier token).
    "tier_hit_on_a_small_pool": Workload(
        "gemma3-3groups",
        {
            "block_size": 4,
            "num_kv_blocks": 37,
            "max_num_batched_tokens": 4,
            "max_num_seqs": 16,
            "offload": "disk:{dir}:8MiB",
        },
        [
            FuzzRequest(
                [
                    103,
                    28,
                    283,
                    94,
                    202,
                    125,
                    44,
                    39,
                    141,
                    60,
                    17,
                    271,
                    295,
                    121,
                    40,
                    40,
                    25,
                    237,
                    297,
                    56,
                    187,
                    18,
                    194,
                    88,
                    78,
                    114,
                    220,
                    148,
                    31,
                    149,
                    22,
                    18,
                    102,
                    157,
                    232,
                    283,
                    82,
                    269,
                    87,
                    174,
                    153,
                ],
                9,
                n=4,
                seed=11,
            ),
        ],
    ),
    # Mistral (every layer slides, window 5 over blocks of 8): two completions of one
    # prompt registered a block, one with its neighbour still in the window and one
    # without: the same content held twice.
    "windows_alone_shared_block": Workload(
        "mistral",
        {"block_size": 8, "num_kv_blocks": 22, "max_num_batched_tokens": 16},
        [
            FuzzRequest([250], 1),
            FuzzRequest(
                [250, 130, 15, 86, 214, 176, 280, 142, 149, 214, 287, 281, 57, 156, 124, 25],
                2,
                n=2,
                seed=11,
            ),
        ],
    ),
}


@pytest.mark.parametrize("name", sorted(SHRUNK))
def test_shrunk_findings_stay_fixed(references: References, name: str) -> None:
    findings = run_workload(SHRUNK[name], references)
    assert not findings, "\n".join(map(str, findings))


@pytest.mark.slow
def test_a_minute_of_random_workloads_finds_nothing(references: References) -> None:
    campaign = run_campaign(references, FUZZ_ARCHS, CI_SECONDS, seed=0, shrink_seconds=60)
    total = sum(c["workloads"] for c in campaign.counts.values())
    assert total >= len(FUZZ_ARCHS), "every architecture ran at least once"
    assert not campaign.findings, campaign.report()
