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


# -- hybrid groups: one full-attention group plus sliding windows ---------------------


@pytest.mark.parametrize("workload", sorted(SMALL))
def test_gemma3_like_small_workloads_with_checks(tmp_path, workload):
    args = ["--workload", workload, "--block-size", "8", "--check", *SMALL[workload]]
    r = simulate(tmp_path, "--model-spec", "gemma3-like", *args)
    assert r["groups"] == ["full", "sliding:1024", "sliding:1024"]
    assert r["duplicate_blocks_peak"] == 0 and r["preemptions"] == 0
    assert r["prefill_tokens_computed"] == r["ideal_prefill_tokens"]
    assert r["prefix_hit_tokens"] + r["prefill_tokens_computed"] == r["prompt_tokens"]
    full = simulate(tmp_path, *args)  # the same hits as full attention alone
    assert (r["prefix_hit_tokens"], r["generated_tokens"]) == (
        full["prefix_hit_tokens"],
        full["generated_tokens"],
    )


def test_gemma3_like_prompts_longer_than_the_window(tmp_path):
    """1300-token identical prompts: window blocks are released, hits still ideal."""
    args = ["--workload", "identical-burst", "--num-requests", "4", "--prompt-len", "1300"]
    r = simulate(tmp_path, "--model-spec", "gemma3-like", "--output-len", "8", "--check", *args)
    assert r["duplicate_blocks_peak"] == 0 and r["preemptions"] == 0
    assert r["prefill_tokens_computed"] == r["ideal_prefill_tokens"] == 1300 + 3 * 4
    assert r["generated_tokens"] == 4 * 8


# Pools that force preemptions with a 32-token window (block 8) yet fit every request.
TIGHT_HYBRID = {"shared-prefix": 40, "multi-turn": 32, "random": 40}


@pytest.mark.parametrize("workload", sorted(TIGHT_HYBRID))
def test_sliding_window_tight_pool_preempts_and_still_finishes(tmp_path, workload):
    args = ["--workload", workload, "--block-size", "8", "--groups", "full,sliding:32"]
    base = simulate(tmp_path, *args, "--check", *SMALL[workload])
    assert base["groups"] == ["full", "sliding:32"] and base["preemptions"] == 0
    assert base["prefill_tokens_computed"] == base["ideal_prefill_tokens"]
    assert base["duplicate_blocks_peak"] == 0
    tight = simulate(
        tmp_path, *args, "--num-blocks", str(TIGHT_HYBRID[workload]),
        "--max-num-batched-tokens", "64", "--check", *SMALL[workload],
    )  # fmt: skip
    assert tight["preemptions"] > 0
    assert tight["requests"] == base["requests"] and tight["rejected"] == 0
    # Generated tokens are a function of each sequence: equal counts (and, for
    # multi-turn, equal follow-up prompts, which contain the answers) mean equal tokens.
    assert tight["generated_tokens"] == base["generated_tokens"]
    assert tight["prompt_tokens"] == base["prompt_tokens"]
    assert tight["duplicate_blocks_peak"] == 0
    assert tight["peak_blocks_used"] <= TIGHT_HYBRID[workload] - 1


@pytest.mark.parametrize(
    "groups", ["full,window:3", "full,sliding:x", "full:3", "full,sliding:", "sliding:-4"]
)
def test_malformed_groups_are_clear_errors(tmp_path, capsys, groups):
    bad = groups.split(",")[-1]
    argv = ["simulate", "--no-progress", "--workload", "random", "--num-requests", "2"]
    assert main([*argv, "--groups", groups]) == 2
    err = capsys.readouterr().err
    assert f"'{bad}'" in err and "sliding:<window" in err


@pytest.mark.parametrize("groups", ["sliding:32,full", "full,full", "full,sliding:8,full"])
def test_any_group_order_shares_like_full_attention(tmp_path, groups):
    r = simulate(
        tmp_path, "--workload", "identical-burst", "--groups", groups, "--check",
        *SMALL["identical-burst"],
    )  # fmt: skip
    assert r["prefill_tokens_computed"] == r["ideal_prefill_tokens"]
    assert r["prefix_hit_tokens"] > 0 and r["duplicate_blocks_peak"] == 0


def test_all_arrivals_rejected_is_reported_not_a_crash(tmp_path):
    r = simulate(
        tmp_path, "--workload", "identical-burst", "--num-blocks", "6", "--prompt-len", "200",
    )  # fmt: skip
    assert r["requests"] == 8 and r["rejected"] == 8
    assert r["generated_tokens"] == 0 and "KV blocks" in r["errors"][0]


def test_window_requests_are_admitted_by_what_a_window_holds(tmp_path):
    # 1300 tokens need 82 blocks per full-attention group; a 64-token window holds
    # only its window plus a chunk, so 2 groups fit in far fewer than 164 blocks.
    args = ["--workload", "identical-burst", "--num-requests", "1", "--prompt-len", "1300"]
    common = ["--max-num-batched-tokens", "256", "--block-size", "16"]
    r = simulate(tmp_path, *args, *common, "--groups", "full,sliding:64", "--num-blocks", "110")
    assert r["rejected"] == 0 and r["generated_tokens"] == 16
    r = simulate(tmp_path, *args, *common, "--groups", "full,full", "--num-blocks", "110")
    assert r["rejected"] == 1


def test_empty_groups_is_a_clear_error(capsys):
    assert main(["simulate", "--no-progress", "--groups", ","]) == 2
    assert "names no group" in capsys.readouterr().err


# -- state groups: a Bamba-like attention group plus Mamba2 state groups ----------------


@pytest.mark.parametrize("workload", sorted(SMALL))
def test_mamba_hybrid_like_small_workloads_with_checks(tmp_path, workload):
    args = ["--workload", workload, "--block-size", "8", "--check", *SMALL[workload]]
    r = simulate(tmp_path, "--model-spec", "mamba-hybrid-like", *args)
    assert r["groups"] == ["full", "mamba:4", "mamba:4", "mamba:4"]
    assert r["duplicate_blocks_peak"] == 0
    assert r["prefix_hit_tokens"] + r["prefill_tokens_computed"] == r["prompt_tokens"]
    # A state resumes only from snapshots: never more hits than full attention alone.
    full = simulate(tmp_path, *args)
    assert r["prefix_hit_tokens"] <= full["prefix_hit_tokens"]
    assert r["generated_tokens"] == full["generated_tokens"]
    if workload == "identical-burst":  # one waits a step, then resumes at the boundary
        assert r["prefill_tokens_computed"] == r["ideal_prefill_tokens"]
    if workload != "random":
        assert r["prefix_hit_tokens"] > 0


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "simulate", "--no-progress", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def assert_one_line_error(proc, *names):
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert all(name in proc.stderr for name in names), proc.stderr
    assert proc.stdout == ""  # refused before the run: no report


def test_an_unwritable_json_path_fails_before_the_run(tmp_path):
    missing = tmp_path / "no-such-dir" / "r.json"
    assert_one_line_error(run_cli("--json", str(missing)), f"--json {missing}", "not a directory")
    assert_one_line_error(run_cli("--json", str(tmp_path)), f"--json {tmp_path}", "directory")


def test_model_spec_and_groups_together_are_refused():
    proc = run_cli("--model-spec", "gemma3-like", "--groups", "full,sliding:512")
    assert_one_line_error(proc, "--model-spec", "--groups")


def test_check_says_the_invariants_held(tmp_path):
    args = ["--workload", "multi-turn", *SMALL["multi-turn"]]
    proc = run_cli(*args, "--check", "--json", str(tmp_path / "r.json"))
    assert proc.returncode == 0, proc.stderr
    steps = json.loads((tmp_path / "r.json").read_text())["steps"]
    assert f"checks: every invariant held after each of the {steps:,} steps" in proc.stdout
    assert "checks:" not in run_cli(*args).stdout
