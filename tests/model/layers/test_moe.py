"""The sparse MoE block against transformers' own blocks: routing, grouping, ties, skipped experts.

Each test loads the same random weights into kvserve's SparseMoeBlock and into
transformers' Qwen3-MoE or Mixtral block and compares outputs, and counts which
of kvserve's experts ran (each expert that has tokens runs once per step,
every other one not at all).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from kvserve.model.checkpoint.config import ModelConfig
from kvserve.model.checkpoint.errors import ModelLoadError
from kvserve.model.checkpoint.moe_config import MoeConfig, moe_config
from kvserve.model.layers.moe import MixtralExpert, SparseMoeBlock
from kvserve.model.models.moe_decoder import gated_expert
from kvserve.model.quant.fusion import fuse_projections

HIDDEN, WIDTH, EXPERTS, TOP_K = 32, 16, 8, 2


def hf_block(family: str, norm_topk_prob: bool = True) -> nn.Module:
    common = dict(
        hidden_size=HIDDEN, num_experts_per_tok=TOP_K, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    torch.manual_seed(0)
    if family == "mixtral":
        config = transformers.MixtralConfig(
            **common, intermediate_size=WIDTH, num_local_experts=EXPERTS
        )
        block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config)
    else:
        config = transformers.Qwen3MoeConfig(
            **common, moe_intermediate_size=WIDTH, num_experts=EXPERTS,
            norm_topk_prob=norm_topk_prob,
        )  # fmt: skip
        block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config)
    for param in block.parameters():
        nn.init.normal_(param, std=0.3)
    return block.eval()


def kvserve_block(hf: nn.Module, family: str, norm_topk_prob: bool = True) -> SparseMoeBlock:
    """kvserve's block holding `hf`'s weights, loaded by the checkpoints' per-expert names."""
    mixtral = family == "mixtral"
    moe = MoeConfig(EXPERTS, TOP_K, WIDTH, norm_topk_prob or mixtral, (True,), mixtral)
    block = SparseMoeBlock(HIDDEN, moe, MixtralExpert if mixtral else gated_expert)
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    state = {"gate.weight": hf.gate.weight}
    for e in range(EXPERTS):
        gate, up = hf.experts.gate_up_proj[e].chunk(2, dim=0)
        for name, weight in zip(names, (gate, up, hf.experts.down_proj[e]), strict=True):
            state[f"experts.{e}.{name}.weight"] = weight
    block.load_state_dict(state, strict=True)
    fuse_projections(block)
    return block.eval()


def calls_per_expert(block: SparseMoeBlock, x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    calls = [0] * EXPERTS
    hooks = [
        expert.register_forward_hook(lambda *_, e=e: calls.__setitem__(e, calls[e] + 1))
        for e, expert in enumerate(block.experts)
    ]
    with torch.no_grad():
        out = block(x)
    for hook in hooks:
        hook.remove()
    return out, calls


@pytest.fixture
def one_thread():
    """The suite's one thread, whatever an earlier test of this worker left (a runner sets
    the process's count): with two, MKL splits a matmul's sums by its rows, and the HF
    block's expert calls take other rows than kvserve's, so their last bits differ."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("family", "norm"), [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", True)]
)
def test_every_expert_gets_tokens_and_runs_once(family, norm, one_thread):
    hf = hf_block(family, norm)
    block = kvserve_block(hf, family, norm)
    x = torch.randn(1, 64, HIDDEN)
    out, calls = calls_per_expert(block, x[0])
    assert calls == [1] * EXPERTS  # 64 tokens reach all 8 experts; each runs once
    with torch.no_grad():
        expected = hf(x)[0]
    assert torch.equal(out, expected)  # the same float32 sums, in the same order


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_experts_without_tokens_never_run(family):
    hf = hf_block(family)
    block = kvserve_block(hf, family)
    x = torch.randn(1, 1, HIDDEN)
    out, calls = calls_per_expert(block, x[0])
    with torch.no_grad():
        _, _, chosen = hf.gate(x[0])
    assert sorted(e for e, n in enumerate(calls) if n) == sorted(chosen[0].tolist())
    assert calls.count(0) == EXPERTS - TOP_K
    with torch.no_grad():
        assert torch.equal(out, hf(x)[0])


def test_routing_ties_are_broken_as_transformers_breaks_them():
    """Experts 1, 4 and 6 share one router row that beats the others: three equal
    probabilities for two places. The two chosen, and their order, are torch.topk's, as in
    transformers; the outputs follow."""
    hf = hf_block("qwen3_moe")
    with torch.no_grad():
        row = hf.gate.weight[1] * 4
        for e in (1, 4, 6):
            hf.gate.weight[e] = row
    block = kvserve_block(hf, "qwen3_moe")
    x = torch.randn(1, 16, HIDDEN)
    x[0, :, :] = x[0, :, :].abs() * row.sign()  # every token prefers the tied experts
    with torch.no_grad():
        _, hf_weights, hf_chosen = hf.gate(x[0])
        weights, chosen = block.gate(x[0])
    assert torch.equal(chosen, hf_chosen)
    assert set(chosen.flatten().tolist()) < {1, 4, 6}  # a tie really was broken
    assert torch.equal(weights, hf_weights)
    out, _ = calls_per_expert(block, x[0])
    with torch.no_grad():
        assert torch.equal(out, hf(x)[0])


def config_of(raw: dict) -> ModelConfig:
    base = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
        vocab_size=100, num_experts_per_tok=2, moe_intermediate_size=16,
    )  # fmt: skip
    return ModelConfig.from_dict({**base, **raw})


def test_qwen3_moe_sparse_layers_follow_step_and_mlp_only_layers():
    arch = {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8}
    moe = moe_config(config_of({**arch, "decoder_sparse_step": 2, "mlp_only_layers": [3]}))
    assert moe.sparse_layers == (False, True, False, False, False, True)
    assert moe_config(config_of({**arch, "num_local_experts": 4})).num_experts == 8
    saved_by_v5 = {"architectures": ["Qwen3MoeForCausalLM"], "num_local_experts": 4}
    assert moe_config(config_of(saved_by_v5)).num_experts == 4


def test_bad_moe_configs_are_refused_by_name():
    with pytest.raises(ModelLoadError, match=r"num_experts_per_tok \(3\) exceeds the 2 experts"):
        moe_config(config_of({"architectures": ["OlmoeForCausalLM"], "num_experts": 2,
                              "num_experts_per_tok": 3}))  # fmt: skip
    with pytest.raises(ModelLoadError, match=r"sliding_window \(4096\) is not supported"):
        moe_config(config_of({"architectures": ["MixtralForCausalLM"], "num_local_experts": 4,
                              "sliding_window": 4096}))  # fmt: skip


def test_a_step_without_tokens_runs_no_expert():
    block = kvserve_block(hf_block("qwen3_moe"), "qwen3_moe")
    out, calls = calls_per_expert(block, torch.empty(0, HIDDEN))
    assert out.shape == (0, HIDDEN) and calls == [0] * EXPERTS
