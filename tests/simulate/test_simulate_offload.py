"""`simulate --offload`: the engine's external tiers and connector, without a model.

The model-free runner keeps each position's token id as its K/V, so every
block a tier loads is checked against the prefix of the request that reads it.
"""

from __future__ import annotations

import json

import pytest

from kvserve.cli import main
from kvserve.offload.cpu_tier import CpuTier
from kvserve.simulate.simulator import SimConfig, simulate
from kvserve.simulate.workloads import WORKLOADS

SMALL = {
    "shared-prefix": dict(
        num_groups=3, prompts_per_group=6, system_len=120, question_len=24, output_len=12
    ),
    "multi-turn": dict(num_conversations=5, num_turns=4, turn_len=24, output_len=16),
}


def run(workload, offload=None, **config):
    config = SimConfig(
        block_size=8, max_num_batched_tokens=128, check=True, offload=offload, **config
    )
    return simulate(WORKLOADS[workload](**SMALL[workload]), config)


@pytest.mark.parametrize("workload", sorted(SMALL))
def test_a_cpu_tier_serves_what_a_small_pool_evicted(workload):
    plain = run(workload, num_blocks=30)
    tiered = run(workload, "cpu:64KiB", num_blocks=30)
    assert plain["evictions"] > 0 and "external_hit_tokens" not in plain
    assert tiered["external_hit_tokens"] > 0
    assert tiered["prefill_tokens_computed"] < plain["prefill_tokens_computed"]
    # 4 bytes per token (the token id), one attention group.
    assert tiered["offload_bytes_loaded"] == 4 * tiered["external_hit_tokens"]
    assert tiered["offload_bytes_saved"] > 0 and tiered["offload_dropped_writes"] == 0
    assert tiered["kv_positions_checked"] >= tiered["external_hit_tokens"]


def test_tier_sizes_count_the_stated_bytes_per_token():
    """The same 4 KiB holds 16x fewer blocks at 64 bytes per token: fewer external hits."""
    small = run("multi-turn", "cpu:4KiB", num_blocks=30, kv_bytes_per_token=64)
    large = run("multi-turn", "cpu:4KiB", num_blocks=30)
    assert small["offload_bytes_loaded"] == 64 * small["external_hit_tokens"]
    assert small["external_hit_tokens"] < large["external_hit_tokens"]


@pytest.mark.parametrize(
    ("groups", "block_size"), [(("full", "sliding:17"), 8), (("full", "mamba:4", "mamba:4"), 4)]
)
def test_hybrid_groups_with_a_cpu_tier(groups, block_size):
    report = simulate(
        WORKLOADS["multi-turn"](**SMALL["multi-turn"]),
        SimConfig(
            block_size=block_size,
            groups=groups,
            num_blocks=60,
            max_num_batched_tokens=128,
            check=True,
            offload="cpu:64KiB",
        ),
    )
    assert report["external_hit_tokens"] > 0
    assert report["kv_positions_checked"] > 0


def test_a_disk_tier_serves_the_next_run(tmp_path):
    offload = f"disk:{tmp_path}:1MiB"
    first = run("shared-prefix", offload, num_blocks=40)
    second = run("shared-prefix", offload, num_blocks=40)
    assert list(tmp_path.iterdir())
    assert second["external_hit_tokens"] > first["external_hit_tokens"]
    assert second["prefill_tokens_computed"] < first["prefill_tokens_computed"] // 2
    # Another K/V size is another model: its files are not this one's.
    other = run("shared-prefix", offload, num_blocks=40, kv_bytes_per_token=8)
    assert other["prefill_tokens_computed"] == first["prefill_tokens_computed"]


def test_a_wrong_block_from_a_tier_fails_the_run(monkeypatch):
    """The check can fail: a tier that answers with another block's payload is caught."""
    get = CpuTier.get

    def swapped(self, key):
        data = get(self, key)
        return None if data is None else bytes(reversed(data[:4])) + data[4:]

    monkeypatch.setattr(CpuTier, "get", swapped)
    with pytest.raises(AssertionError, match="holds token"):
        run("multi-turn", "cpu:64KiB", num_blocks=30)


def test_the_command_line(tmp_path, capsys):
    out = tmp_path / "r.json"
    args = ["simulate", "--workload", "multi-turn", "--conversations", "5", "--turns", "4"]
    args += ["--num-blocks", "60", "--no-progress", "--offload", "cpu:64KiB"]
    assert main([*args, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["offload"] == "cpu:64KiB" and report["external_hit_tokens"] > 0
    assert "external hit tokens (tiers)" in capsys.readouterr().out
    assert main([*args, "--replicas", "2"]) == 2
    assert "--replicas 1" in capsys.readouterr().err
    assert main([*args[:-1], "cpu:12XB"]) == 2
    assert "bad size '12XB'" in capsys.readouterr().err
