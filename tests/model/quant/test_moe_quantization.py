"""int8 and int4 on a mixture-of-experts checkpoint: every expert packed, the router not.

The experts are modules of their own, so the modes pack them as they pack a
dense MLP (tests/model/quant/test_quantization.py, whose accuracy bounds apply
here unchanged); the router's weight is a plain parameter that stays float: a
packed router would change which experts run.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.model.quant.quant_linear import Int4Linear, Int8Linear, PackedLinear
from tests.model.moe_checkpoints import moe_checkpoint
from tests.model.quant.test_quantization import (
    assert_runs_its_packed_weights,
    logits_of,
    runner_for,
)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return moe_checkpoint(tmp_path_factory, "qwen3_moe")


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_every_expert_is_packed_and_the_router_stays_float(qwen3_moe, mode):
    runner = runner_for(qwen3_moe.path, mode)
    layers = runner.model.model.layers
    experts = {n: m for n, m in layers.named_modules() if ".experts." in n}
    packed = [m for m in experts.values() if isinstance(m, PackedLinear)]
    moe = runner.model.moe
    sparse = sum(moe.sparse_layers)
    assert len(packed) == 2 * moe.num_experts * sparse  # gate/up stacked, down
    assert all(isinstance(m, Int4Linear if mode == "int4" else Int8Linear) for m in packed)
    sparse_layers = [layer for layer, s in zip(layers, moe.sparse_layers, strict=True) if s]
    routers = [layer.mlp.gate.weight for layer in sparse_layers]
    assert all(w.dtype == torch.float32 for w in routers)
    assert_runs_its_packed_weights(runner, logits_of(runner_for(qwen3_moe.path)), mode)


def test_a_shared_expert_is_packed_and_its_gate_stays_float(tmp_path_factory):
    """Qwen2-MoE: the shared expert is a gated MLP like the routed ones; its sigmoid gate
    (one row) is not a linear layer."""
    runner = runner_for(moe_checkpoint(tmp_path_factory, "qwen2_moe").path, "int8")
    block = runner.model.model.layers[0].mlp
    assert isinstance(block.shared_expert.gate_up_proj, Int8Linear)
    assert isinstance(block.shared_expert.down_proj, Int8Linear)
    assert block.shared_expert_gate.weight.dtype == torch.float32
