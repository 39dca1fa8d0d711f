"""Tiers that cannot take a block: refused at start, or every failed write counted.

A tier smaller than one block would store nothing while looking like a cache, so the
engine refuses it, naming it and the block's size. A write that fails at run time (a
read-only directory) is counted in `offload_dropped_writes`, never as saved bytes, and
its cause is logged once, not once per block. A tier directory removed while the
engine runs is created again.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[3 + (7 * i + j) % 250 for j in range(13 + 2 * i)] for i in range(4)]
# qwen3 (tests/conftest.py): 3 layers, 2 KV heads of 16; blocks of 4 tokens, float32.
PAYLOAD = 3 * 2 * (2 * 16 * 4) * 4  # one hash block: K and V of every layer


def make(path: str, offload: str) -> LLM:
    return LLM(
        path, block_size=4, num_kv_blocks=64, dtype="float32", num_threads=1, offload=offload
    )


def run(path: str, offload: str, prompts=PROMPTS) -> tuple[dict, list]:
    llm = make(path, offload)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    llm.engine.connector.store.flush()  # the disk writes have landed (or failed)
    stats = llm.stats()
    llm.shutdown()
    return stats, [o.outputs[0].token_ids for o in outputs]


def block_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.kvb"))


def unwritable_directory(tmp_path: Path) -> Path:
    """A directory whose files cannot be created: read-only by mode, or (for root, whom
    modes do not stop) /sys; skips where neither refuses a write."""
    own = tmp_path / "read-only"
    own.mkdir()
    own.chmod(0o555)
    for candidate in (own, Path("/sys")):
        probe = candidate / "kvserve-probe.kvb"
        try:
            probe.touch()
        except OSError:
            return candidate
        probe.unlink()
    pytest.skip("no directory here refuses writes")


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_a_tier_smaller_than_one_block_is_refused_naming_it_and_the_size(
    kind, checkpoints, tmp_path
):
    path = checkpoints["qwen3"].path
    where = f"disk:{tmp_path / 'kv'}:" if kind == "disk" else "cpu:"
    spec = f"{where}{PAYLOAD - 1}B"
    with pytest.raises(ValueError, match="cannot hold one KV block") as info:
        make(path, spec)
    message = str(info.value)
    assert f"offload tier '{spec}'" in message
    need = int(re.search(r"takes ([\d,]+) bytes", message).group(1).replace(",", ""))
    # The payload alone for the CPU; a file adds its header on disk.
    assert need == PAYLOAD if kind == "cpu" else need > PAYLOAD
    # The size the message names is enough: a tier of exactly that stores blocks.
    stats, _ = run(path, f"{where}{need}B")
    assert stats["offload_dropped_writes"] == 0 and stats["offload_bytes_saved"] > 0


def test_writes_to_a_read_only_directory_are_counted_once_each_and_logged_once(
    checkpoints, tmp_path, caplog
):
    path = checkpoints["qwen3"].path
    good = tmp_path / "kv"
    stats, tokens = run(path, f"disk:{good}:1MiB")
    saved = len(block_files(good))
    assert saved >= len(PROMPTS) and stats["offload_dropped_writes"] == 0
    assert stats["offload_bytes_saved"] == saved * PAYLOAD

    bad = unwritable_directory(tmp_path)
    with caplog.at_level(logging.WARNING):
        stats, bad_tokens = run(path, f"disk:{bad}:1MiB")
    assert bad_tokens == tokens  # the engine went on as if no tier were there
    assert stats["offload_dropped_writes"] == saved  # every block it tried
    assert stats["offload_bytes_saved"] == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert str(bad) in warnings[0] and "offload_dropped_writes" in warnings[0]

    # In front of it, a CPU tier takes each block: saved once, the disk's drops counted.
    stats, _ = run(path, f"cpu:1MiB,disk:{bad}:1MiB")
    assert stats["offload_bytes_saved"] == saved * PAYLOAD
    assert stats["offload_dropped_writes"] == saved


def test_a_tier_directory_removed_while_running_is_created_again(checkpoints, tmp_path):
    path = checkpoints["qwen3"].path
    kv = tmp_path / "kv"
    llm = make(path, f"disk:{kv}:1MiB")
    llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    llm.engine.connector.store.flush()
    assert block_files(kv)
    shutil.rmtree(kv)
    later = [[p + 1 for p in prompt] for prompt in PROMPTS[2:]]
    llm.generate(later, GREEDY, use_tqdm=False)
    llm.engine.connector.store.flush()
    stats = llm.stats()
    llm.shutdown()
    assert kv.is_dir() and block_files(kv)
    assert stats["offload_dropped_writes"] == 0
    # What landed after the removal is there for the next engine.
    again = make(path, f"disk:{kv}:1MiB")
    again.generate(later, GREEDY, use_tqdm=False)
    assert again.stats()["external_hit_tokens"] > 0
    again.shutdown()
