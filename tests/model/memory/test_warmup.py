"""Dummy steps (warm-up, activation profile) run on a scratch cache: the pool, the
generators and the block ids the engine handed out stay as they were."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from kvserve.model import ModelRunner
from kvserve.model.memory.pool_size import run_profile_steps
from kvserve.model.memory.warmup import warm_up, warmup_shapes


@pytest.fixture(params=["llama", "gemma3", "bamba"])
def runner(request, checkpoints, gemma3_checkpoint, bamba_checkpoint):
    """A small runner of each kind of model (full attention, sliding windows, Mamba
    state pages), its pool filled with numbers a dummy step would overwrite."""
    known = {"llama": checkpoints["llama"], "gemma3": gemma3_checkpoint, "bamba": bamba_checkpoint}
    path = known[request.param].path
    runner = ModelRunner(path, block_size=4, num_blocks=12, device="cpu", num_threads=1)
    torch.manual_seed(1)
    with torch.inference_mode():
        for k, v in runner.kv_tensors:
            k.normal_()
            v.normal_()
    return runner


def snapshot(runner: ModelRunner) -> list[torch.Tensor]:
    return [t.clone() for pair in runner.kv_tensors for t in pair]


def assert_untouched(runner: ModelRunner, before: list[torch.Tensor], tensors: list) -> None:
    assert runner.num_blocks == 12
    assert [t for pair in runner.kv_tensors for t in pair] == tensors  # the same objects
    after = [t for pair in runner.kv_tensors for t in pair]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_warm_up_logs_its_shapes_and_leaves_the_pool_and_generators(runner, caplog):
    before = snapshot(runner)
    tensors = [t for pair in runner.kv_tensors for t in pair]
    state = runner._default_generator.get_state()
    with caplog.at_level(logging.INFO, logger="kvserve.model.memory.warmup"):
        count = warm_up(runner, max_num_seqs=8, max_num_batched_tokens=64)
    assert count == len(warmup_shapes(8, 64, runner.max_model_len)) == 6
    (line,) = [r.getMessage() for r in caplog.records if "warm-up" in r.getMessage()]
    assert re.fullmatch(rf"warm-up: {count} shapes in \d+\.\d\d s", line)
    assert_untouched(runner, before, tensors)
    assert torch.equal(runner._default_generator.get_state(), state)
    assert runner._generators == {}


def test_the_profile_steps_run_on_every_kind_of_model(runner):
    # A token budget over the model's length (512): the long step splits it.
    before = snapshot(runner)
    tensors = [t for pair in runner.kv_tensors for t in pair]
    run_profile_steps(runner, max_num_batched_tokens=1100, max_num_seqs=8)
    assert_untouched(runner, before, tensors)


def test_the_runner_warms_up_on_accelerators_only(checkpoints, caplog):
    with caplog.at_level(logging.INFO, logger="kvserve.model"):
        ModelRunner(checkpoints["qwen3"].path, block_size=4, num_blocks=8, device="cpu")
    assert "KV cache: 8 blocks" in caplog.text
    assert "warm-up" not in caplog.text


def test_release_drops_the_weights_and_the_pool_and_refuses_steps(checkpoints):
    import weakref

    from model_driver import make_chunk

    runner = ModelRunner(checkpoints["qwen3"].path, block_size=4, num_blocks=8, device="cpu")
    io_view = runner.kv_tensors  # what the tiers' block I/O holds: the same list
    watched = [weakref.ref(t) for pair in runner.kv_tensors for t in pair]
    watched += [weakref.ref(p) for p in runner.model.parameters()]
    runner.release()
    assert io_view == [] and runner.model is None
    assert [ref for ref in watched if ref() is not None] == []
    with pytest.raises(RuntimeError, match="released"):
        runner.execute([make_chunk("r", [5], 0, [[1]])])
