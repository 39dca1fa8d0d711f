"""`kvserve chat` as a user runs it: a real process, turns on stdin, answers streamed."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from kvserve.model.demo import ensure_demo_model


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return ensure_demo_model(tmp_path_factory.mktemp("demo"))


def chat(args, stdin):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "kvserve.cli", "chat", "--block-size", "4", *args]
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, env=env, timeout=300)


def figures(out):
    """(prompt tokens, cached tokens, generated tokens) of each turn."""
    found = re.findall(r"\[prompt (\d+) tokens, (\d+) cached; (\d+) generated", out)
    return [tuple(map(int, f)) for f in found]


def test_turns_keep_the_conversation_and_hit_the_prefix_cache(demo):
    proc = chat(
        ["--model", demo, "--system", "Be brief.", "--max-tokens", "8"],
        "Hello there\nAnd then?\n/reset\nHello there\n",
    )
    assert proc.returncode == 0, proc.stderr
    turns = figures(proc.stdout)
    assert len(turns) == 3 and all(generated == 8 for _, _, generated in turns)
    (p1, c1, _), (p2, c2, _), (p3, c3, _) = turns
    assert c1 == 0 and p2 > p1 and c2 >= p1 - 4  # turn 2 reuses turn 1's whole prompt
    assert "(conversation cleared)" in proc.stdout
    assert p3 == p1 and c3 > 0  # after /reset: the first turn again, from the cache
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_model_without_a_chat_template_is_one_line(checkpoints):
    # --log-level warning: without it the KV cache's INFO line comes first (the model loaded).
    proc = chat(["--model", checkpoints["qwen3"].path, "--log-level", "warning"], "hi\n")
    assert proc.returncode == 2
    assert "chat template" in proc.stderr or "no tokenizer" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
