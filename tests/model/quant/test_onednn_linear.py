"""bfloat16 linear layers pre-packed for oneDNN: F.linear's bits, every layer of a bfloat16
CPU model packed (a tied lm_head too), float32 and quantized models as they were."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvserve.model import ModelRunner, loader
from kvserve.model.quant.onednn_linear import OneDNNLinear, onednn_available
from kvserve.model.quant.quant_linear import PackedLinear
from tests.model.model_driver import prompt
from tests.model.quant.teacher_forcing import teacher_forced_logits

pytestmark = pytest.mark.skipif(
    not onednn_available(torch.bfloat16, torch.device("cpu")), reason="no oneDNN bfloat16 here"
)
PROMPT = prompt(37, salt=9)


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_the_same_bits_as_f_linear(rows):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=gen).bfloat16()
    bias = torch.randn(96, generator=gen).bfloat16()
    x = torch.randn(2, rows, 80, generator=gen).bfloat16()
    out = OneDNNLinear(weight, bias)(x)
    assert out.shape == (2, rows, 96)
    assert torch.equal(out, nn.functional.linear(x, weight, bias))


def runner(path: str, dtype: str, quantization: str = "none") -> ModelRunner:
    return ModelRunner(
        path, block_size=4, num_blocks=64, dtype=dtype, num_threads=1, quantization=quantization
    )


def kinds(model: nn.Module) -> set[type]:
    return {type(m) for m in model.modules() if isinstance(m, nn.Linear | OneDNNLinear)}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # biases and an own lm_head; tied
def test_a_bfloat16_model_is_packed_and_its_logits_keep_their_bits(checkpoints, arch, monkeypatch):
    path = checkpoints[arch].path
    packed = runner(path, "bfloat16")
    assert packed.model is not None
    assert kinds(packed.model) == {OneDNNLinear}
    assert isinstance(packed.model.lm_head, OneDNNLinear)
    monkeypatch.setattr(loader, "onednn_available", lambda dtype, device: False)
    plain = runner(path, "bfloat16")
    assert plain.model is not None and kinds(plain.model) == {nn.Linear}
    assert torch.equal(
        teacher_forced_logits(packed, PROMPT, packed.model),
        teacher_forced_logits(plain, PROMPT, plain.model),
    )


def test_float32_and_quantized_models_are_left_alone(checkpoints):
    path = checkpoints["qwen2"].path
    exact = runner(path, "float32")
    assert exact.model is not None
    assert kinds(exact.model) == {nn.Linear} and exact.model.lm_head is None
    int8 = runner(path, "bfloat16", "int8")
    assert int8.model is not None
    assert OneDNNLinear not in kinds(int8.model)
    assert isinstance(int8.model.lm_head, PackedLinear)
