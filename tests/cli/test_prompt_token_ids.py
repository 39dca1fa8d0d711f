"""`kvserve generate --prompt-token-ids`: prompts as token ids, for a checkpoint without a
tokenizer; errors name the prompt the user gave, never an internal request id."""

from __future__ import annotations

import json

import pytest
import transformers
from _cli import SMALL, kvserve, one_line_error

from kvserve.cli.prompt_ids import read_prompt_token_ids

QUIET = ("--log-level", "warning")  # stderr: the error alone, not the KV cache's INFO line


@pytest.mark.slow
def test_a_checkpoint_without_a_tokenizer_runs_token_ids(checkpoints, tmp_path):
    ck = checkpoints["qwen3"]
    ids = tmp_path / "ids.jsonl"
    ids.write_text("[9, 10, 11]\n\n[12, 13]\n")
    proc = kvserve(
        "generate", "--model", ck.path, *SMALL, "--max-tokens", "3", "--in-order",
        "--prompt-token-ids", "[1, 2, 3]",
        "--prompt-token-ids", "[[4, 5], [6, 7, 8]]",
        "--prompt-token-ids", f"@{ids}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    shown = [line for line in proc.stdout.splitlines() if line.startswith("prompt: ")]
    expected = [[1, 2, 3], [4, 5], [6, 7, 8], [9, 10, 11], [12, 13]]
    assert shown == [f"prompt: {p}" for p in expected]
    assert "requests: 5" in proc.stdout
    # A text prompt needs the tokenizer it lacks: the error says how to give token ids.
    proc = kvserve("generate", "--model", ck.path, *SMALL, *QUIET, "--prompt", "hello")
    one_line_error(proc, "no tokenizer", "--prompt-token-ids")


@pytest.mark.slow
def test_token_ids_give_what_the_text_gives(demo_path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(demo_path, local_files_only=True)
    text = "The capital of France is"
    ids = json.dumps(tokenizer.encode(text))
    common = ("--model", demo_path, *SMALL, "--max-tokens", "6", "--ignore-eos")
    by_text = kvserve("generate", *common, "--prompt", text)
    by_ids = kvserve("generate", *common, "--prompt-token-ids", ids)
    assert by_text.returncode == by_ids.returncode == 0, by_ids.stderr
    completion = by_text.stdout.split("prompt: ")[1].splitlines()[1]
    assert completion == by_ids.stdout.split("prompt: ")[1].splitlines()[1]
    assert f"prompt: {json.loads(ids)}" in by_ids.stdout


def test_errors_name_the_users_prompt_not_a_request(checkpoints):
    ck = checkpoints["qwen3"]  # vocabulary 320
    proc = kvserve(
        "generate", "--model", ck.path, *SMALL, *QUIET, "--n", "2",
        "--prompt-token-ids", "[[1, 2], [1, 999]]",
    )  # fmt: skip
    line = one_line_error(proc)
    assert (
        line == "kvserve generate: error: prompt 1: token ids [999] outside the vocabulary [0, 320)"
    )
    proc = kvserve("generate", "--model", ck.path, "--prompt-token-ids", "[1, 2", "--prompt", "x")
    one_line_error(proc, "--prompt-token-ids", "not with --prompt")
    proc = kvserve("generate", "--model", ck.path, "--prompt-token-ids", "@/nonexistent/ids")
    one_line_error(proc, "--prompt-token-ids @/nonexistent/ids: cannot read")


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("[1, 2", "not JSON"),
        ("[]", "non-empty list of ints"),
        ('[1, "a"]', "non-empty list of ints"),
        ("[[1], []]", "non-empty list of ints"),
        ("[true]", "non-empty list of ints"),
        ("7", "non-empty list of ints"),
    ],
)
def test_malformed_values_are_named(value, says):
    with pytest.raises(ValueError, match="--prompt-token-ids") as info:
        read_prompt_token_ids([value])
    assert says in str(info.value)


def test_a_bad_line_of_a_file_is_named(tmp_path):
    path = tmp_path / "ids.jsonl"
    path.write_text("[1, 2]\n[3, x]\n")
    with pytest.raises(ValueError, match=rf"@{path} line 2: not JSON"):
        read_prompt_token_ids([f"@{path}"])
    path.write_text("[1, 2]\n[[3]]\n")
    with pytest.raises(ValueError, match=r"line 2: expected a non-empty JSON list of ints"):
        read_prompt_token_ids([f"@{path}"])
    path.write_text("\n")
    with pytest.raises(ValueError, match="holds no prompt"):
        read_prompt_token_ids([f"@{path}"])
