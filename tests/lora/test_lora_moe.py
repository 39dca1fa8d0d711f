"""LoRA adapters on mixtures of experts give peft's tokens: the experts' fused weights
(transformers 5's `target_parameters`, one LoRA per expert; PEFT turns a transformers-4
`target_modules` list naming them into that, with a doubled rank for the fused
gate_up_proj), Qwen2-MoE's shared expert, and the attention, each row of a batch mixing
two adapters and the base model with its own (kvserve.lora.targets, kvserve.lora.weights).
What cannot be adapted is refused by name."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import save_file

from kvserve import LLM, LoRARequest
from tests.lora.conftest import make_adapter
from tests.lora.test_lora_oracle import PROMPTS, expected, run
from tests.model.moe_checkpoints import moe_checkpoint

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
EXPERTS = ["gate_up_proj", "down_proj"]


def moe_llm(ck, **kwargs) -> LLM:
    return LLM(ck.path, block_size=4, dtype="float32", num_threads=1, enable_lora=True,
               max_loras=2, **kwargs)  # fmt: skip


def test_qwen2_moe_experts_and_shared_expert(tmp_path_factory, tmp_path):
    """One adapter on the attention, the shared expert and every expert's fused weights;
    one on the shared expert only (rsLoRA): a mixed batch, chunked and preempted."""
    ck = moe_checkpoint(tmp_path_factory, "qwen2_moe")
    adapters = {
        "all": make_adapter(
            ck, tmp_path / "all", seed=5, targets=ATTENTION + MLP, parameters=EXPERTS
        ),
        "shared": make_adapter(
            ck, tmp_path / "shared", seed=6, targets=MLP, rank=8, use_rslora=True
        ),
    }
    for name in adapters:  # neither leaves the answer alone
        assert adapters[name].reference(PROMPTS[0], 8) != ck.reference(PROMPTS[0], 8)
    llm = moe_llm(ck, num_kv_blocks=10, max_num_batched_tokens=6)
    names = ["all", "shared", None, "all"]
    assert run(llm, adapters, PROMPTS, names) == expected(ck, adapters, PROMPTS, names)
    assert llm.stats()["preemptions"] > 0


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_fused_experts_as_peft_converts_them(arch, tmp_path_factory, tmp_path):
    """Mixtral's w1/w2/w3 and Qwen3-MoE's gate/up/down_proj as target_modules: PEFT adapts
    the fused expert weights (rank_pattern and alpha_pattern on gate_up_proj); and an
    adapter on the experts' down_proj alone (the only wrapper, so no base_layer keys)."""
    ck = moe_checkpoint(tmp_path_factory, arch)
    experts = ["w1", "w2", "w3"] if arch == "mixtral" else MLP
    adapters = {
        "experts": make_adapter(ck, tmp_path / "e", seed=7, targets=["q_proj", *experts]),
        "down": make_adapter(
            ck, tmp_path / "d", seed=8, targets=[], parameters=["mlp.experts.down_proj"]
        ),
    }
    config = json.loads((tmp_path / "e" / "adapter_config.json").read_text())
    assert config["target_parameters"] and config["rank_pattern"]  # what PEFT wrote
    assert adapters["down"].reference(PROMPTS[0], 8) != ck.reference(PROMPTS[0], 8)
    llm = moe_llm(ck, num_kv_blocks=64)
    names = ["experts", "down", None, "experts"]
    assert run(llm, adapters, PROMPTS, names) == expected(ck, adapters, PROMPTS, names)


def write_config(path, **fields) -> str:
    path.mkdir()
    save_file({}, path / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, **fields}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return str(path)


REFUSED = {
    "router": (dict(target_modules=["gate"]), "the router (gate)"),
    "router-param": (dict(target_parameters=["mlp.gate.weight"]), "the router (gate)"),
    "shared-gate": (dict(target_modules=["shared_expert_gate"]), "shared_expert_gate"),
    "expert-bias": (dict(target_parameters=["mlp.experts.gate_up_proj_bias"]),
                    "target parameter mlp.experts.gate_up_proj_bias not supported"),
    "bad-pattern": (dict(target_modules=["q_proj"], rank_pattern={"(": 4}), "not a regex"),
}  # fmt: skip


def test_what_cannot_be_adapted_is_refused_by_name(tmp_path_factory, tmp_path):
    ck = moe_checkpoint(tmp_path_factory, "qwen2_moe")
    llm = moe_llm(ck, num_kv_blocks=16)
    for case, (fields, message) in REFUSED.items():
        request = LoRARequest(case, 1, write_config(tmp_path / case, **fields))
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            llm.generate([PROMPTS[0]], lora_request=request, use_tqdm=False)
