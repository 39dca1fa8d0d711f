"""ModelRunner set-up: KV cache sizing, and malformed chunks refused with the request named."""

from __future__ import annotations

import logging

import pytest

from kvserve.model import ModelRunner
from kvserve.model.memory.kv_memory import CPU_CAP, cpu_kv_cache_memory
from tests.model.model_driver import make_chunk


def make(checkpoints, arch="llama", **kwargs):
    kwargs.setdefault("num_threads", 1)
    return ModelRunner(checkpoints[arch].path, block_size=4, device="cpu", **kwargs)


def test_bytes_per_block_and_memory_budget(checkpoints):
    runner = make(checkpoints, kv_cache_memory=1 << 20)
    # K and V, 2 layers, 4 tokens, 2 kv heads, head_dim 32 (explicit in the config), float32
    assert runner.bytes_per_block == 2 * 2 * 4 * 2 * 32 * 4
    assert runner.num_blocks == (1 << 20) // runner.bytes_per_block
    k, v = runner.kv_caches[0]
    assert k.shape == v.shape == (runner.num_blocks, 4, 2, 32)
    assert len(runner.kv_caches) == 2


def test_default_size_is_capped_and_logged(checkpoints, caplog):
    with caplog.at_level(logging.INFO, logger="kvserve.model.runner"):
        runner = make(checkpoints)
    budget = cpu_kv_cache_memory()
    assert 0 < budget <= CPU_CAP
    assert runner.num_blocks == budget // runner.bytes_per_block
    assert f"{runner.num_blocks} blocks" in caplog.text


def test_too_small_a_cache_is_refused(checkpoints):
    with pytest.raises(ValueError, match="at least 2"):
        make(checkpoints, kv_cache_memory=100)
    with pytest.raises(ValueError, match="num_blocks"):
        make(checkpoints, num_blocks=1)


@pytest.mark.parametrize(
    ("chunk", "message"),
    [
        (make_chunk("bad-empty", [], 0, [[1]]), "bad-empty.*at least one token"),
        (make_chunk("bad-id", [5, 999], 0, [[1]]), "bad-id.*token ids"),
        (make_chunk("bad-neg", [-1], 0, [[1]]), "bad-neg.*token ids"),
        (make_chunk("bad-block", [5], 0, [[400]]), "bad-block.*block ids"),
        (make_chunk("bad-pos", [5], -2, [[1]]), "bad-pos.*start_pos"),
    ],
)
def test_malformed_chunks_name_the_request(runners, chunk, message):
    with pytest.raises(ValueError, match=message):
        runners["qwen3"].execute([chunk])


def test_short_block_table_is_refused(runners):
    with pytest.raises(ValueError, match=r"short.*cannot hold 5 tokens"):
        runners["qwen3"].execute([make_chunk("short", [1, 2, 3, 4, 5], 0, [[1]])])
