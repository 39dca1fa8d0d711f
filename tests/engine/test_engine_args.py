"""`LLM(**engine args)` from Python: what the command line accepts, Python accepts, and what
it refuses, Python refuses with the same ValueError, before a model is loaded."""

from __future__ import annotations

import argparse

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.cli.common import parse_bytes
from kvserve.engine.engine_args import EngineArgs
from kvserve.events.config import KVEventsConfig

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPT = [5, 17, 42, 9, 100, 3, 7]


def make(path: str, **kwargs) -> LLM:
    return LLM(path, block_size=4, dtype="float32", num_threads=1, **kwargs)


@pytest.mark.parametrize("device", ["tpu", "cuda:99", "mps", "", 0])
def test_a_device_kvserve_cannot_use_is_a_value_error_naming_it(device, checkpoints):
    with pytest.raises(ValueError, match="device") as info:
        make(checkpoints["qwen3"].path, device=device)
    assert repr(device) in str(info.value) or str(device) in str(info.value)
    # Nothing was half-built: the next engine, on a device that exists, runs.
    llm = make(checkpoints["qwen3"].path, device="cpu", num_kv_blocks=16)
    assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is there to be used")
def test_cuda_without_cuda_says_so(checkpoints):
    with pytest.raises(ValueError, match=r"device 'cuda' is not available: .*use 'cpu'"):
        make(checkpoints["qwen3"].path, device="cuda")


@pytest.mark.parametrize(
    ("text", "expected"),
    [("64KiB", 64 * 1024), ("0.5MB", 500_000), ("2GiB", 2 * 1024**3), ("65536", 65536)],
)
def test_kv_cache_memory_takes_the_command_lines_sizes(text, expected):
    # One parser: Python and the command line read every size alike.
    assert EngineArgs(kv_cache_memory=text).kv_cache_memory == expected == parse_bytes(text)
    assert EngineArgs(kv_cache_memory=expected).kv_cache_memory == expected


def test_kv_cache_memory_string_sizes_the_pool_like_its_bytes(checkpoints):
    path = checkpoints["qwen3"].path
    by_text = make(path, kv_cache_memory="48KiB")
    by_int = make(path, kv_cache_memory=48 * 1024)
    assert by_text.stats()["num_kv_blocks"] == by_int.stats()["num_kv_blocks"] > 1
    out_text = by_text.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert out_text == by_int.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("bad", ["2 gigs", "-1GiB", "0", 0, -5, 1.5, True, [1]])
def test_a_bad_kv_cache_memory_names_the_option(bad):
    with pytest.raises(ValueError, match="kv_cache_memory"):
        EngineArgs(kv_cache_memory=bad)
    if isinstance(bad, str):  # and the command line refuses it as well
        with pytest.raises(argparse.ArgumentTypeError):
            parse_bytes(bad)


def test_kv_events_config_is_checked_before_the_model_loads(tmp_path):
    missing = str(tmp_path / "no-such-model")  # loading it would be another error
    with pytest.raises(ValueError, match="enable_kv_cache_events must be true or false"):
        LLM(missing, kv_events_config={"enable_kv_cache_events": "yes"})
    with pytest.raises(ValueError, match="must be a JSON object"):
        LLM(missing, kv_events_config="[1, 2]")
    with pytest.raises(TypeError, match="kv_events_config must be a dict"):
        LLM(missing, kv_events_config=[1, 2])
    text = '{"enable_kv_cache_events": true, "hwm": 5}'
    assert EngineArgs(kv_events_config=text).kv_events_config == text  # checked, kept
    assert KVEventsConfig.from_any(text) == KVEventsConfig(enable_kv_cache_events=True, hwm=5)


@pytest.mark.parametrize("bad", [0, -0.5, 1.01, 3, float("nan"), "0.5", True, None])
def test_gpu_memory_utilization_outside_0_1_names_the_option(bad):
    with pytest.raises(ValueError, match="gpu_memory_utilization") as info:
        EngineArgs(gpu_memory_utilization=bad)
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_gpu_memory_utilization_is_ignored_on_the_cpu(checkpoints):
    # The CPU pool is sized from RAM: a share of 1 % sizes it exactly as 90 % does.
    path = checkpoints["qwen3"].path
    low = make(path, device="cpu", gpu_memory_utilization=0.01)
    default = make(path, device="cpu")
    assert EngineArgs(gpu_memory_utilization=1).gpu_memory_utilization == 1
    # MemAvailable may move a little between the two loads; 1 % would be a hundredth.
    low_blocks, default_blocks = (llm.stats()["num_kv_blocks"] for llm in (low, default))
    assert low_blocks >= 0.9 * default_blocks
    assert low.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
