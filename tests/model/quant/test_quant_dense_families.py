"""int8 and int4 on Mistral, Phi-3 and Gemma 2: every projection packed (Phi-3's stored
fused qkv and gate/up too), and the packed model runs its packed weights (the bounds of
test_quantization.py)."""

from __future__ import annotations

import pytest

from kvserve.model.quant.quant_linear import Int4Linear, Int8Linear, PackedLinear
from tests.model.quant.test_quantization import (
    assert_runs_its_packed_weights,
    logits_of,
    runner_for,
)


@pytest.mark.parametrize(
    ("arch", "mode"), [("mistral", "int4"), ("phi3", "int4"), ("gemma2", "int8")]
)
def test_dense_families_pack_every_projection(dense_checkpoints, arch, mode):
    path = dense_checkpoints[arch].path
    reference = logits_of(runner_for(path))
    runner = runner_for(path, mode)
    kind = Int4Linear if mode == "int4" else Int8Linear
    for layer in runner.model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for module in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            assert isinstance(module, PackedLinear) and isinstance(module, kind), arch
    assert_runs_its_packed_weights(runner, reference, mode)
