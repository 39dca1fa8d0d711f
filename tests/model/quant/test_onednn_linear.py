"""Linear layers pre-packed for oneDNN: F.linear's bits in bfloat16, every layer of a
bfloat16 CPU model packed (a tied lm_head too); float32 packed too unless exact (on
kvserve's panels where its kernel runs, else oneDNN's), its logits within rounding of the
exact mode's; quantized models as they were."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvserve.engine.engine_args import EXACT_ENV
from kvserve.model import ModelRunner, loader
from kvserve.model.quant.onednn_linear import OneDNNLinear, onednn_available
from kvserve.model.quant.panel_linear import PanelLinear, panels_available
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


def runner(path: str, dtype: str, quantization: str = "none", exact: bool = False) -> ModelRunner:
    return ModelRunner(
        path,
        block_size=4,
        num_blocks=64,
        dtype=dtype,
        num_threads=1,
        quantization=quantization,
        exact=exact,
    )


def kinds(model: nn.Module) -> set[type]:
    linears = nn.Linear | OneDNNLinear | PanelLinear
    return {type(m) for m in model.modules() if isinstance(m, linears)}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # biases and an own lm_head; tied
def test_a_bfloat16_model_is_packed_and_its_logits_keep_their_bits(checkpoints, arch, monkeypatch):
    path = checkpoints[arch].path
    packed = runner(path, "bfloat16")
    assert packed.model is not None
    assert kinds(packed.model) == {OneDNNLinear}
    assert isinstance(packed.model.lm_head, OneDNNLinear)
    monkeypatch.setattr(loader, "onednn_available", lambda dtype, device, exact: False)
    plain = runner(path, "bfloat16")
    assert plain.model is not None and kinds(plain.model) == {nn.Linear}
    assert torch.equal(
        teacher_forced_logits(packed, PROMPT, packed.model),
        teacher_forced_logits(plain, PROMPT, plain.model),
    )


@pytest.mark.parametrize("kernel", ["panels", "onednn"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_float32_is_packed_unless_exact_and_its_logits_stay_within_rounding(
    checkpoints, arch, kernel, monkeypatch
):
    monkeypatch.delenv(EXACT_ENV)  # the suite runs exact; the users' default is not
    cpu = torch.device("cpu")
    if kernel == "onednn":  # what a CPU without kvserve's float32 kernel packs
        monkeypatch.setattr(loader, "panels_available", lambda dtype, device, exact: False)
    elif not panels_available(torch.float32, cpu, exact=False):
        pytest.skip("no float32 panel kernel on this CPU")
    path = checkpoints[arch].path
    fast = runner(path, "float32")
    exact = runner(path, "float32", exact=True)
    assert fast.model is not None and exact.model is not None
    packed = PanelLinear if kernel == "panels" else OneDNNLinear
    assert kinds(fast.model) == {packed} and not fast.exact
    assert kinds(exact.model) == {nn.Linear} and exact.exact
    fast_logits = teacher_forced_logits(fast, PROMPT, fast.model)
    exact_logits = teacher_forced_logits(exact, PROMPT, exact.model)
    assert torch.allclose(fast_logits, exact_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(fast_logits.argmax(-1), exact_logits.argmax(-1))
    monkeypatch.setenv(EXACT_ENV, "1")  # what the suite sets: exact whatever the caller says
    again = runner(path, "float32")
    assert again.exact and again.model is not None and kinds(again.model) == {nn.Linear}


def test_packed_float32_keys_its_tiers_apart_from_the_exact_mode(checkpoints, monkeypatch):
    from kvserve.engine.engine_args import EngineArgs
    from kvserve.engine.tiers import _model_io

    monkeypatch.delenv(EXACT_ENV)
    path, args = checkpoints["qwen2"].path, EngineArgs(block_size=4)

    def fingerprint(dtype: str, exact: bool) -> bytes:
        return _model_io(runner(path, dtype, exact=exact), args)[1]

    exact = fingerprint("float32", exact=True)
    assert fingerprint("float32", exact=False) != exact  # other last bits: other blocks
    assert fingerprint("float32", exact=True) == exact
    # bfloat16 packs with F.linear's bits, but its fast mode runs kvserve's kernel where
    # the CPU has AVX-512 BF16 (panel_linear): other blocks there
    fast, exact_bf16 = fingerprint("bfloat16", exact=False), fingerprint("bfloat16", exact=True)
    assert (fast != exact_bf16) == panels_available(torch.bfloat16, torch.device("cpu"), False)


def test_quantized_models_are_left_alone(checkpoints, monkeypatch):
    monkeypatch.delenv(EXACT_ENV)
    int8 = runner(checkpoints["qwen2"].path, "bfloat16", "int8")
    assert int8.model is not None
    assert OneDNNLinear not in kinds(int8.model)
    assert isinstance(int8.model.lm_head, PackedLinear)
