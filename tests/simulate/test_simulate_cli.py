"""`kvserve simulate` end to end, through the command line."""

import json
import subprocess
import sys

import pytest

from kvserve.cli import main


def simulate(tmp_path, *args):
    out = tmp_path / "r.json"
    assert main(["simulate", "--no-progress", "--json", str(out), *args]) == 0
    return json.loads(out.read_text())


KEYS = {
    "requests",
    "prompt_tokens",
    "ideal_prefill_tokens",
    "prefill_tokens_computed",
    "prefix_hit_tokens",
    "hit_rate",
    "peak_blocks_used",
    "duplicate_blocks_peak",
    "preemptions",
    "steps",
    "generated_tokens",
    "manager_seconds",
    "manager_us_per_prompt_token",
}


def test_identical_burst_defaults_meet_the_ideal(tmp_path):
    r = simulate(tmp_path, "--workload", "identical-burst")
    assert r.keys() >= KEYS
    # 8 x 600 tokens, block 16: 37 shared full blocks; each request computes its 8-token tail.
    assert r["prefill_tokens_computed"] == r["ideal_prefill_tokens"] == 600 + 7 * 8
    assert r["duplicate_blocks_peak"] == 0
    assert r["requests"] == 8 and r["generated_tokens"] == 8 * 16


@pytest.mark.parametrize("workload", ["shared-prefix", "multi-turn"])
def test_default_sharing_workloads_within_one_percent_of_ideal(tmp_path, workload):
    r = simulate(tmp_path, "--workload", workload)
    assert r["prefill_tokens_computed"] <= 1.01 * r["ideal_prefill_tokens"]
    assert r["duplicate_blocks_peak"] == 0 and r["preemptions"] == 0


SMALL = {
    "identical-burst": ["--num-requests", "4", "--prompt-len", "90", "--output-len", "20"],
    "shared-prefix": [
        "--num-groups", "3", "--prompts-per-group", "4", "--system-len", "100",
        "--question-len", "20", "--output-len", "12",
    ],
    "multi-turn": [
        "--conversations", "4", "--turns", "3", "--turn-len", "20", "--output-len", "20"
    ],
    "random": ["--num-requests", "12", "--min-len", "10", "--max-len", "80"],
}  # fmt: skip


@pytest.mark.parametrize("workload", sorted(SMALL))
def test_small_workloads_with_checks(tmp_path, workload):
    args = ["--workload", workload, "--block-size", "8", "--check", *SMALL[workload]]
    r = simulate(tmp_path, *args)
    assert r.keys() >= KEYS
    assert r["duplicate_blocks_peak"] == 0
    assert r["prefill_tokens_computed"] == r["ideal_prefill_tokens"]
    assert r["prefix_hit_tokens"] + r["prefill_tokens_computed"] == r["prompt_tokens"]
    if workload == "random":
        assert r["prefix_hit_tokens"] == 0


@pytest.mark.parametrize("workload", sorted(SMALL))
def test_no_prefix_caching_computes_every_prompt_token(tmp_path, workload):
    r = simulate(tmp_path, "--workload", workload, "--no-prefix-caching", *SMALL[workload])
    assert r["preemptions"] == 0
    assert r["prefill_tokens_computed"] == r["prompt_tokens"]
    assert r["prefix_hit_tokens"] == 0


TIGHT = {"identical-burst": 15, "shared-prefix": 24, "multi-turn": 24, "random": 24}


@pytest.mark.parametrize("workload", sorted(SMALL))
def test_tight_pool_preempts_and_still_finishes(tmp_path, workload):
    base = simulate(tmp_path, "--workload", workload, "--block-size", "8", *SMALL[workload])
    tight = simulate(
        tmp_path, "--workload", workload, "--block-size", "8", "--num-blocks", str(TIGHT[workload]),
        "--max-num-batched-tokens", "64", "--check", *SMALL[workload],
    )  # fmt: skip
    assert tight["preemptions"] > 0
    assert tight["requests"] == base["requests"] and tight["rejected"] == 0
    assert tight["generated_tokens"] == base["generated_tokens"]
    assert tight["peak_blocks_used"] <= TIGHT[workload] - 1


def test_own_trace_format(tmp_path):
    trace = tmp_path / "t.jsonl"
    shared = list(range(1, 41))
    lines = [
        {"id": "a", "arrival": 0, "prompt_token_ids": [*shared, 100, 101], "max_tokens": 3},
        {"id": "b", "arrival": 5, "prompt_token_ids": [*shared, 200], "max_tokens": 2},
        {"id": "c", "arrival": 0.5, "prompt_token_ids": [9] * 10, "max_tokens": 1},
    ]
    trace.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    r = simulate(tmp_path, "--trace", str(trace), "--block-size", "8", "--check")
    assert r["requests"] == 3
    assert r["prefix_hit_tokens"] == 40  # b finds a's 5 full blocks
    assert r["generated_tokens"] == 6


@pytest.mark.parametrize("block_size", [1, 16, 64, 512])
def test_mooncake_trace_equal_hash_ids_give_equal_blocks(tmp_path, block_size):
    trace = tmp_path / "m.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 1100, "output_length": 4, "hash_ids": [1, 2, 3]},
        {"timestamp": 1000, "input_length": 1300, "output_length": 4, "hash_ids": [1, 2, 4]},
        {"timestamp": 2000, "input_length": 600, "output_length": 4, "hash_ids": [5, 6]},
    ]
    trace.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    r = simulate(tmp_path, "--trace", str(trace), "--block-size", str(block_size))
    assert r["prompt_tokens"] == 3000
    # The second request shares exactly the first two 512-token blocks (ids 1, 2).
    assert r["prefix_hit_tokens"] == 1024
    assert r["prefill_tokens_computed"] == r["ideal_prefill_tokens"] == 3000 - 1024


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not JSON"),
        ('{"foo": 1}', "neither"),
        ('{"prompt_token_ids": [], "max_tokens": 2}', "non-empty"),
        ('{"input_length": 2000, "output_length": 1, "hash_ids": [1]}', "fewer than"),
    ],
)
def test_bad_trace_lines_are_clear_errors(tmp_path, capsys, line, message):
    trace = tmp_path / "bad.jsonl"
    trace.write_text(line + "\n")
    assert main(["simulate", "--no-progress", "--trace", str(trace)]) == 2
    err = capsys.readouterr().err
    assert message in err and "bad.jsonl:1" in err


def test_console_script_help_explains_options():
    out = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "simulate", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for option in ("--workload", "--trace", "--num-blocks", "--check", "--json", "--hash"):
        assert option in out
