"""Anything but a regular file under a block's name is a miss, never opened, warned once.

A FIFO opened for reading blocks until a writer comes: before the fix, one FIFO in a
shared tier directory hung the engine thread while /health said 200. Every lookup here
runs in a thread with a timeout, so a regression fails instead of hanging the suite.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvserve import LLM, SamplingParams
from kvserve.offload import DiskTier
from kvserve.offload.store import TierStack

FP = hashlib.sha256(b"model A").digest()
KEY = bytes([0]) + hashlib.sha256(b"fifo").digest()[:16]
PAYLOAD = b"kv" * 100
TIMEOUT = 10.0


def within_timeout(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) on a daemon thread (never joined at exit); fails, not hangs, if it blocks."""
    result: list[Any] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn(*args))
        except BaseException as exc:  # re-raised on the test's thread
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(TIMEOUT)
    if thread.is_alive():
        pytest.fail(f"{getattr(fn, '__name__', fn)} blocked for {TIMEOUT} s")
    if errors:
        raise errors[0]
    return result[0]


def warnings_about(caplog: pytest.LogCaptureFixture, path: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and path in r.getMessage()
    ]


@pytest.mark.parametrize("kind", ["fifo", "directory", "device link"])
def test_a_non_regular_block_path_is_a_miss_warned_once(tmp_path, caplog, kind):
    tier = DiskTier(tmp_path, 10_000, FP)
    path = tier.file_path(KEY)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        os.mkdir(path)
    else:
        os.symlink("/dev/zero", path)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert within_timeout(tier.get, KEY) is None
    assert not tier.contains(KEY)  # not a hit the connector would plan to load
    assert tier.keys() == [] and tier.used_bytes == 0
    warned = warnings_about(caplog, path)
    assert len(warned) == 1 and "not a regular file" in warned[0], warned
    assert os.path.lexists(path)  # someone else's: left alone


def test_non_regular_files_present_at_start_are_not_counted(tmp_path):
    first = DiskTier(tmp_path, 10_000, FP)
    os.mkfifo(first.file_path(KEY))
    other = bytes([1]) + KEY[1:]
    os.mkdir(first.file_path(other))
    tier = DiskTier(tmp_path, 10_000, FP)
    assert tier.keys() == [] and tier.used_bytes == 0
    # Another process's directory and FIFO appearing later are not counted either.
    third = bytes([2]) + KEY[1:]
    os.mkfifo(tier.file_path(third))
    tier.rescan_interval = 0.0
    tier.put(bytes([3]) + KEY[1:], PAYLOAD)
    assert tier.keys() == [bytes([3]) + KEY[1:]]


def test_a_put_replaces_a_fifo_and_the_block_is_read_back(tmp_path):
    tier = DiskTier(tmp_path, 10_000, FP)
    os.mkfifo(tier.file_path(KEY))
    assert within_timeout(tier.get, KEY) is None
    tier.put(KEY, PAYLOAD)
    assert tier.contains(KEY) and within_timeout(tier.get, KEY) == PAYLOAD


def test_a_counted_block_replaced_by_a_fifo_is_no_longer_counted(tmp_path):
    tier = DiskTier(tmp_path, 10_000, FP)
    tier.put(KEY, PAYLOAD)
    path = tier.file_path(KEY)
    os.unlink(path)  # another process puts a FIFO in its place
    os.mkfifo(path)
    assert within_timeout(tier.get, KEY) is None
    assert tier.keys() == [] and tier.used_bytes == 0


def test_a_directory_in_the_way_of_a_write_is_a_counted_drop(tmp_path):
    disk = DiskTier(tmp_path, 10_000, FP)
    os.mkdir(disk.file_path(KEY))
    stack = TierStack([disk])
    stack.put(KEY, PAYLOAD)
    stack.flush()
    stack.close()
    assert stack.dropped_writes == 1 and stack.dropped_by_medium == {"STORAGE": 1}
    assert stack.get(KEY) is None


def test_the_engine_goes_on_past_fifos_under_every_block_name(checkpoints, tmp_path):
    """Every block file of a first run replaced by a FIFO: the next engine misses them all
    and answers the same, instead of hanging in open()."""
    path, kv = checkpoints["qwen3"].path, tmp_path / "kv"
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [[3 + (5 * i + j) % 200 for j in range(17)] for i in range(2)]

    def run() -> tuple[list, dict]:
        llm = LLM(
            path,
            block_size=4,
            num_kv_blocks=64,
            dtype="float32",
            num_threads=1,
            offload=f"disk:{kv}:1MiB",
        )
        try:
            outputs = llm.generate(prompts, greedy, use_tqdm=False)
            llm.engine.connector.store.flush()
            return [o.outputs[0].token_ids for o in outputs], llm.stats()
        finally:
            llm.shutdown()

    tokens, _ = within_timeout(run)
    files = sorted(Path(kv).glob("*.kvb"))
    assert files
    for file in files:
        file.unlink()
        os.mkfifo(file)
    again, stats = within_timeout(run)
    assert again == tokens and stats["external_hit_tokens"] == 0
