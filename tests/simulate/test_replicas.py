"""`simulate --replicas`: several engines behind a router that knows them from their events."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.cli import main
from kvserve.simulate.replicas import simulate_replicas
from kvserve.simulate.router import SimRouter
from kvserve.simulate.simulator import SimConfig
from kvserve.simulate.workloads import WORKLOADS

SMALL = {
    "shared-prefix": dict(
        num_groups=8, prompts_per_group=8, system_len=256, question_len=32, output_len=16
    ),
    # 10 conversations on 4 replicas: round-robin cannot keep a conversation in place.
    "multi-turn": dict(num_conversations=10, num_turns=4, turn_len=40, output_len=24),
}
ROOT = Path(__file__).resolve().parents[2]
TIMING = {"wall_seconds", "manager_seconds", "manager_us_per_prompt_token"}


def run(workload: str, routing: str, replicas: int = 4, **config) -> dict:
    config.setdefault("check", True)
    return simulate_replicas(
        WORKLOADS[workload](**SMALL[workload]), SimConfig(**config), replicas, routing
    )


@pytest.mark.parametrize("workload", sorted(SMALL))
def test_cache_aware_routing_nears_one_pool_and_predicts_every_hit(workload):
    cache_aware = run(workload, "cache-aware")
    round_robin = run(workload, "round-robin")
    single = cache_aware["single_pool"]["prefill_tokens_computed"]
    assert cache_aware["prefill_tokens_computed"] < round_robin["prefill_tokens_computed"]
    assert cache_aware["prefill_tokens_computed"] <= 1.10 * single
    assert cache_aware["prefill_vs_single_pool"] <= 1.10
    assert cache_aware["load_balance"] <= 1.5
    for report in (cache_aware, round_robin):
        assert report["predictions_wrong"] == 0
        assert (
            report["predictions_exact"]
            == report["requests"]
            == len(report["errors"]) + sum(r["requests"] for r in report["per_replica"])
        )
        assert report["preemptions"] == report["evictions"] == 0
        # Without preemptions every prompt token is either a first-admission hit or computed.
        for line in [*report["per_replica"], report]:
            assert (
                line["prefix_hit_tokens"] + line["prefill_tokens_computed"]
                == (line["prompt_tokens"])
            )
            assert line["readmission_hit_tokens"] == 0
        assert report["hit_rate"] == report["prefix_hit_tokens"] / report["prompt_tokens"]
    assert cache_aware["prefix_hit_tokens"] > 0
    assert all(r["requests"] > 0 for r in round_robin["per_replica"])


def test_conversations_stay_with_their_history():
    """Every later turn hits its whole history, exactly as in one pool."""
    report = run("multi-turn", "cache-aware")
    assert report["prefill_tokens_computed"] == report["single_pool"]["prefill_tokens_computed"]
    counts = [r["requests"] for r in report["per_replica"]]
    assert sorted(counts) == [8, 8, 12, 12]  # 10 conversations of 4 turns: 3, 3, 2, 2


def test_holding_a_request_behind_its_prefix_in_flight_keeps_predictions_exact(monkeypatch):
    """Without the hold, requests sent in one step share blocks nobody has announced yet:
    the replicas hit more than the router predicted (and cache-aware cannot see it)."""
    held = run("shared-prefix", "cache-aware")
    assert held["held_requests"] > 0 and held["predictions_wrong"] == 0
    monkeypatch.setattr(SimRouter, "_shares_in_flight_prefix", lambda *args: False)
    blind = run("shared-prefix", "cache-aware")
    assert blind["held_requests"] == 0
    assert blind["predictions_wrong"] > 0
    assert blind["predictions_wrong"] == sum(
        r["predictions_wrong"] - r["predictions_hit_less"] for r in blind["per_replica"]
    )  # every one hit more than predicted
    assert blind["prefill_tokens_computed"] > held["prefill_tokens_computed"]


HYBRID = {
    "shared-prefix": dict(
        num_groups=4, prompts_per_group=5, system_len=120, question_len=24, output_len=12
    ),
    "multi-turn": dict(num_conversations=5, num_turns=3, turn_len=24, output_len=16),
    "identical-burst": dict(num_requests=6, prompt_len=70, output_len=12),
}


@pytest.mark.parametrize(
    ("groups", "block_size"),
    [(("full", "sliding:17"), 8), (("full", "mamba:4", "mamba:4"), 4), (("full", "full"), 8)],
)
@pytest.mark.parametrize("workload", sorted(HYBRID))
def test_hybrid_groups_are_predicted_exactly(workload, groups, block_size):
    """Sliding windows, state snapshots (and the one-step wait of a state hit): the
    router's views apply each replica's rules, so every first hit is still predicted."""
    config = SimConfig(groups=groups, block_size=block_size, max_num_batched_tokens=128, check=True)
    report = simulate_replicas(WORKLOADS[workload](**HYBRID[workload]), config, 3)
    assert report["predictions_wrong"] == 0
    assert report["predictions_exact"] == report["requests"]
    assert report["prefix_hit_tokens"] > 0


def test_a_small_pool_per_replica_against_one_pool_of_all_the_blocks():
    report = run("shared-prefix", "cache-aware", num_blocks=40)
    assert report["num_blocks"] == 40
    assert report["single_pool"]["num_blocks"] == 4 * 40
    assert report["evictions"] > 0
    total = report["predictions_exact"] + report["predictions_wrong"]
    assert total == report["requests"]
    # Wrong predictions here are blocks evicted between routing and admission.
    assert report["predictions_wrong"] == report["predictions_hit_less"]
    assert report["preemptions"] == sum(r["preemptions"] for r in report["per_replica"])


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown routing policy 'nearest'"):
        run("multi-turn", "nearest")
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        run("multi-turn", "cache-aware", replicas=0)
    with pytest.raises(ValueError, match="one engine"):
        run("multi-turn", "cache-aware", kv_events_config={"enable_kv_cache_events": True})


CLI_MULTI_TURN = [
    "--workload", "multi-turn", "--conversations", "10", "--turns", "4",
    "--turn-len", "40", "--output-len", "24", "--block-size", "16", "--no-progress",
]  # fmt: skip


def test_the_command_line_routes_over_replicas(tmp_path):
    out = tmp_path / "r.json"
    args = [*CLI_MULTI_TURN, "--replicas", "4", "--json", str(out)]
    command = [sys.executable, "-m", "kvserve", "simulate", *args]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["replicas"] == 4 and report["routing"] == "cache-aware"
    assert len(report["per_replica"]) == 4
    assert report["predictions_wrong"] == 0 and report["load_balance"] <= 1.5
    assert report["prefill_vs_single_pool"] <= 1.10
    assert "replica 3" in result.stdout and "computed / one pool" in result.stdout
    rr = tmp_path / "rr.json"
    assert main(["simulate", *args[:-1], str(rr), "--routing", "round-robin"]) == 0
    round_robin = json.loads(rr.read_text())
    assert round_robin["prefill_tokens_computed"] > report["prefill_tokens_computed"]


def test_one_replica_is_the_plain_simulation(tmp_path):
    reports = []
    for extra in ([], ["--replicas", "1", "--routing", "round-robin"]):
        out = tmp_path / f"r{len(reports)}.json"
        assert main(["simulate", *CLI_MULTI_TURN, "--json", str(out), *extra]) == 0
        reports.append({k: v for k, v in json.loads(out.read_text()).items() if k not in TIMING})
    assert reports[0] == reports[1]
    assert "replicas" not in reports[0]


def test_events_publish_for_one_replica_only(capsys):
    code = main(["simulate", *CLI_MULTI_TURN, "--replicas", "2", "--kv-events-config", "{}"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--replicas 1" in err and "Traceback" not in err


def test_answers_of_spread_lengths_break_round_robins_accidental_affinity():
    # 8 chats on 4 replicas: with equal answers every turn arrives in one order and
    # round-robin sends each chat back to the replica that holds it; spread lengths
    # reorder the turns, as real chats do, and only cache-aware keeps them in place.
    from kvserve.simulate.workloads import multi_turn

    def computed(routing: str, spread: int) -> int:
        workload = multi_turn(
            num_conversations=8, num_turns=4, turn_len=40, output_len=24, output_spread=spread
        )
        report = simulate_replicas(workload, SimConfig(check=True), 4, routing)
        assert report["predictions_wrong"] == 0
        return report["prefill_tokens_computed"]

    assert computed("round-robin", 0) == computed("cache-aware", 0)
    assert computed("round-robin", 12) > 1.2 * computed("cache-aware", 12)
    answers = [
        r.max_tokens
        for r in multi_turn(num_conversations=8, output_spread=12, output_len=24).requests
    ]
    assert len(set(answers)) > 1 and all(12 <= n <= 36 for n in answers)
    with pytest.raises(ValueError, match="output_spread"):
        multi_turn(output_len=10, output_spread=10)
