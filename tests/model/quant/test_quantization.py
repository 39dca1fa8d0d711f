"""Quantized runners on the tiny checkpoints: what gets packed, and logits near float's.

Random tiny models have no meaningful accuracy (tests/model/quant/test_quant_smollm2.py
measures that on the real default model); here the point is the plumbing of
every architecture: which modules are packed, that the packed model runs
through the engine's own step, and that its logits stay near the float
model's, by a margin each weight format explains.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from kvserve import LLM
from kvserve.model import ModelLoadError, ModelRunner
from kvserve.model.memory import kv_io
from kvserve.model.memory.kv_io import kv_fingerprint
from kvserve.model.quant.quant_linear import Int4Linear, Int8Linear, PackedLinear
from kvserve.model.quant.quantize import QUANTIZATIONS, linear_modules, replace_module
from tests.model.gguf_files import write_gguf
from tests.model.model_driver import NEW, generate, prompt
from tests.model.quant.teacher_forcing import teacher_forced_logits
from tests.model.stacked_state import stacked_state

PROMPT = prompt(40, salt=5)
LOGIT_ERROR = {"int8": 0.06, "int4": 0.5}
"""Mean logit error allowed against the float model, relative to its logits' spread
(measured about 0.03 and 0.3 on the tiny checkpoints' random weights; unrelated logits
would be near 1.1)."""
KERNEL_ERROR = 0.12
"""The same against a float model holding the packed weights: the kernel's int8 activations
only (each block of 32 inputs rounded to 1/254 of its largest). Measured 0.017-0.031 on the
dense and MoE checkpoints, 0.094 on a Qwen3-MoE of Q4_0 experts whose top-k routing flips
with them; plain bfloat16 makes 0.016."""


def runner_for(path, quantization: str = "none") -> ModelRunner:
    return ModelRunner(
        path, block_size=4, num_blocks=64, dtype="float32", num_threads=1,
        quantization=quantization,
    )  # fmt: skip


def logits_of(runner: ModelRunner) -> torch.Tensor:
    return teacher_forced_logits(runner, PROMPT, runner.model)


def relative_error(logits: torch.Tensor, reference: torch.Tensor) -> float:
    return ((logits - reference).abs().mean() / reference.std()).item()


def assert_runs_its_packed_weights(runner: ModelRunner, float_logits: torch.Tensor, mode: str):
    """Near the float model by the weights' error, and nearer still to a float model that
    holds the packed weights (what the kernels multiply by, rebuilt through them)."""
    unpacked = copy.deepcopy(runner.model)
    for name, module in list(unpacked.named_modules()):
        if isinstance(module, PackedLinear):
            linear = torch.nn.Linear(module.in_features, module.out_features, bias=False)
            linear.weight = torch.nn.Parameter(module.dequantized(), requires_grad=False)
            linear.bias = module.bias
            replace_module(unpacked, name, linear)
    logits = logits_of(runner)
    assert relative_error(logits, teacher_forced_logits(runner, PROMPT, unpacked)) < KERNEL_ERROR
    assert 0 < relative_error(logits, float_logits) < LOGIT_ERROR[mode]


@pytest.fixture(scope="module")
def float_logits(checkpoints) -> dict[str, torch.Tensor]:
    return {arch: logits_of(runner_for(ck.path)) for arch, ck in checkpoints.items()}


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_every_projection_and_the_lm_head_are_packed(checkpoints, float_logits, mode):
    for arch, ck in checkpoints.items():
        runner = runner_for(ck.path, mode)
        model = runner.model
        layers = dict(model.model.layers.named_modules())
        assert not any(isinstance(m, torch.nn.Linear) for m in layers.values()), arch
        packed = [m for m in layers.values() if isinstance(m, PackedLinear)]
        assert len(packed) == 4 * runner.config.num_layers, arch  # q/k/v and gate/up stacked
        kind = Int4Linear if mode == "int4" else Int8Linear
        assert all(isinstance(m, kind) for m in packed), arch
        # The lm_head is packed at 8 bits in both modes; a tied one gets its own copy.
        assert isinstance(model.lm_head, Int8Linear), arch
        assert isinstance(model.model.embed_tokens, torch.nn.Embedding), arch
        assert_runs_its_packed_weights(runner, float_logits[arch], mode)
        tokens = generate(runner, [PROMPT[:9], PROMPT[:17]], NEW)
        assert all(len(t) == NEW and max(t) < runner.vocab_size for t in tokens)


@pytest.mark.parametrize("fixture", ["gemma3_checkpoint", "bamba_checkpoint"])
def test_hybrid_models_pack_what_the_kernels_can_run(request, fixture):
    """Gemma 3 (sliding windows, soft-capped logits) and Bamba (Mamba projections): every
    projection whose width the kernel takes (a multiple of 64) is packed, the rest stay
    float."""
    path = request.getfixturevalue(fixture).path
    reference = logits_of(runner_for(path))
    runner = runner_for(path, "int4")
    for name, module in linear_modules(runner.model).items():
        weight_shape = (module.out_features, module.in_features)
        assert weight_shape[1] % 64, f"{name} {weight_shape} could have been packed"
    layers = list(runner.model.model.layers.modules())
    assert any(isinstance(m, Int4Linear) for m in layers)
    assert_runs_its_packed_weights(runner, reference, "int4")


def gguf_runners(model, path: Path, qtype: T) -> tuple[ModelRunner, dict[str, torch.Tensor]]:
    reference = write_gguf(model, path, qtype)
    return runner_for(path, "gguf"), reference


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1], ids=lambda t: t.name)
def test_gguf_mode_keeps_4bit_blocks_with_their_rows_in_place(checkpoints, tmp_path, qtype):
    """Llama's q/k rows come back in transformers' order, the codes in the file's: each packed
    weight is the file's dequantized one, bit for bit (float16 scales and offsets, the
    file's own)."""
    ck = checkpoints["llama"]
    runner, reference = gguf_runners(ck.hf_model, tmp_path / "m.gguf", qtype)
    reference = stacked_state(reference)
    packed = {n: m for n, m in runner.model.named_modules() if isinstance(m, PackedLinear)}
    assert len(packed) == 4 * runner.config.num_layers + 1
    assert all(isinstance(m, Int4Linear) for m in packed.values())
    for name, module in packed.items():
        expected = reference[f"{name}.weight"]
        assert torch.equal(module.dequantized(), expected), name


def test_gguf_mode_requantizes_q8_0_and_keeps_float_tensors_float(checkpoints, tmp_path):
    """Qwen2, tied embeddings: a Q8_0 file gets int8 layers and an int8 copy of the
    embeddings for the logits; an F16 file is not quantized at all, so gguf is none."""
    model = checkpoints["qwen2"].hf_model
    runner, _ = gguf_runners(model, tmp_path / "q8.gguf", T.Q8_0)
    layers = [m for m in runner.model.model.layers.modules() if isinstance(m, PackedLinear)]
    assert len(layers) == 4 * runner.config.num_layers
    assert all(isinstance(m, Int8Linear) for m in layers)
    assert isinstance(runner.model.lm_head, Int8Linear)
    runner, _ = gguf_runners(model, tmp_path / "f16.gguf", T.F16)
    assert not any(isinstance(m, PackedLinear) for m in runner.model.modules())
    assert runner.model.lm_head is None
    expected = generate(runner_for(tmp_path / "f16.gguf"), [PROMPT[:9]], NEW)
    assert generate(runner, [PROMPT[:9]], NEW) == expected


def test_modes_are_checked_with_one_line_errors(checkpoints):
    path = checkpoints["qwen3"].path
    with pytest.raises(ModelLoadError, match=r"own blocks, and .* is a Hugging Face"):
        runner_for(path, "gguf")
    with pytest.raises(ValueError, match="quantization must be one of none, int8, int4, gguf"):
        LLM(path, quantization="int2", num_kv_blocks=8)
    assert QUANTIZATIONS == ("none", "int8", "int4", "gguf")


def test_the_tiers_fingerprint_tells_packed_weights_apart(checkpoints, monkeypatch):
    """A disk tier written by a float engine must not serve an int4 one (other K/V)."""
    runner = runner_for(checkpoints["qwen3"].path)
    args = (runner.model_dir, runner.dtype, runner.kv_cache_specs, 4, "sha256", 0)
    prints = {mode: kv_fingerprint(*args, quantization=mode) for mode in QUANTIZATIONS}
    assert len(set(prints.values())) == len(QUANTIZATIONS)
    # a change to the packed kernel's numbers is a change of key, for packed weights only
    monkeypatch.setattr(kv_io, "PACKED_NUMBERS", kv_io.PACKED_NUMBERS + 1)
    for mode in QUANTIZATIONS:
        changed = kv_fingerprint(*args, quantization=mode) != prints[mode]
        assert changed == (mode != "none"), mode
