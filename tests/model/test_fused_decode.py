"""The fused decode (kvserve.model.fused_decode): a decode step's layers in one C
call give the bits of the Python path that runs the same kernels module by module.

Each test runs the same requests twice on one runner, once with the plan and once
without, through the tests' scheduler loop (prefills and mixed steps take the modules
either way; pure decode steps take the call when it is planned), and compares every
generated token and every reported logprob exactly.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from kvserve.engine.engine_args import EXACT_ENV
from kvserve.model import ModelRunner
from kvserve.model.cpu_kernels import quant_matmul
from kvserve.model.fused_decode import FusedDecode
from kvserve.model.quant.panel_linear import PanelLinear
from kvserve.sampling_params import SamplingParams
from tests.model.gguf_files import write_gguf
from tests.model.model_driver import Driver, Request, prompt

NEW = 12
quant_matmul.enable()
KERNEL = quant_matmul.kernel()
PANELS = {
    "bfloat16": KERNEL is not None and KERNEL.dense_bf16,
    "float32": KERNEL is not None and KERNEL.dense_f32,
}
"""Whether this CPU runs float layers of each dtype on kvserve's kernels (panel_linear)."""
SHAPES = [(5, 0), (11, 0), (3, 2), (17, 4), (9, 4)]
"""(prompt length, arrival step): rows join while others decode, so batches of 1 to 5 rows
and contexts of different lengths meet in one step."""


@pytest.fixture(autouse=True)
def fast_float32(monkeypatch):
    monkeypatch.delenv(EXACT_ENV)  # the suite runs exact; the users' default is not


def requests() -> list[Request]:
    params = SamplingParams(temperature=0.0, logprobs=4, ignore_eos=True)
    return [
        Request(f"r{i}", prompt(n, salt=i), NEW, params=params, arrival_step=at)
        for i, (n, at) in enumerate(SHAPES)
    ]


def runner_for(path, quantization: str, dtype: str) -> ModelRunner:
    return ModelRunner(
        path, block_size=4, num_blocks=96, dtype=dtype, num_threads=2, quantization=quantization
    )


def liven(model: torch.nn.Module) -> None:
    """Random biases and norm weights, in place (the plan holds their addresses): the
    checkpoints' are zeros and ones, which a swapped or dropped one would not show."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                noise = torch.randn(param.shape, generator=gen) * 0.2
                param.add_(noise.to(param.dtype))


def assert_same_bits_both_ways(runner: ModelRunner) -> FusedDecode:
    """The requests with the plan and without it: the same tokens and logprobs."""
    assert runner.model is not None
    fused = runner.model.fused_decode
    assert fused is not None, "not planned"
    liven(runner.model)
    with_plan = requests()
    Driver(runner).run(with_plan)
    assert fused.steps >= NEW  # the decode steps took the call
    runner.model.fused_decode = None
    try:
        without = requests()
        Driver(runner).run(without)
    finally:
        runner.model.fused_decode = fused
    for a, b in zip(with_plan, without, strict=True):
        assert a.output == b.output, a.request_id
        assert a.logprobs == b.logprobs, a.request_id
    return fused


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("arch", "mode"), [("llama", "int4"), ("qwen2", "int8")])
def test_the_call_gives_the_modules_bits(checkpoints, arch, mode, dtype):
    """Llama (biases on every projection, head size 32) and Qwen2 (q/k/v biases, tied
    embeddings), 4-bit and 8-bit weights."""
    assert_same_bits_both_ways(runner_for(checkpoints[arch].path, mode, dtype))


def test_q4_0_gguf_weights_take_the_call(checkpoints, tmp_path):
    """llama.cpp's Q4_0 blocks (float16 scales, no offsets), as a 1B model runs them."""
    path = tmp_path / "llama.gguf"
    write_gguf(checkpoints["llama"].hf_model, path, T.Q4_0)
    assert_same_bits_both_ways(runner_for(path, "gguf", "float32"))


def test_a_sliding_window_model_takes_the_call(dense_checkpoints):
    """Mistral: every layer in a sliding-window KV cache group, whose reads the call takes
    from that group's metadata."""
    runner = runner_for(dense_checkpoints["mistral"].path, "int4", "bfloat16")
    assert any(runner.config.layer_windows), "the checkpoint has no window"
    assert_same_bits_both_ways(runner)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_float_weights_take_the_call(checkpoints, arch, dtype):
    """Unquantized layers (PanelLinear: kvserve's kernel on the weights' panels, in the
    modules and in the call alike); Qwen2's tied lm_head packs the embeddings."""
    if not PANELS[dtype]:
        pytest.skip(f"no {dtype} panel kernel on this CPU")
    runner = runner_for(checkpoints[arch].path, "none", dtype)
    assert runner.model is not None
    assert isinstance(runner.model.model.layers[0].mlp.down_proj, PanelLinear)
    assert_same_bits_both_ways(runner)


def test_what_the_call_does_not_cover_keeps_the_modules(checkpoints):
    """Not planned: float weights in the exact mode (F.linear's bits), Qwen3 (q/k norms),
    an exact float32 runner (torch's ops, not the kernels)."""
    for path, mode, dtype, exact in [
        (checkpoints["llama"].path, "none", "float32", True),
        (checkpoints["llama"].path, "none", "bfloat16", True),
        (checkpoints["qwen3"].path, "int4", "bfloat16", False),
        (checkpoints["llama"].path, "int4", "float32", True),
    ]:
        runner = ModelRunner(path, block_size=4, num_blocks=32, dtype=dtype, num_threads=1,
                             quantization=mode, exact=exact)  # fmt: skip
        assert runner.model is not None and runner.model.fused_decode is None, (path, mode)


def test_a_fast_float32_step_outside_its_scope_keeps_the_modules(checkpoints):
    """The plan runs only where the modules would run the kernels: a float32 forward
    outside the runner's step (its float32 scope closed) leaves it alone."""
    runner = runner_for(checkpoints["llama"].path, "int4", "float32")
    assert runner.model is not None and runner.model.fused_decode is not None
    x = torch.zeros(1, runner.config.hidden_size)
    cos = torch.ones(1, 1, runner.config.head_dim)
    assert not runner.model.fused_decode.run(x, (cos, cos), runner.kv_caches, [])
