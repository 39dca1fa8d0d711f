"""LoRA adapters on mixtures of experts give peft's tokens: the experts' fused weights
(transformers 5's `target_parameters`, one LoRA per expert; PEFT turns a transformers-4
`target_modules` list naming them into that, with a doubled rank for the fused
gate_up_proj), Qwen2-MoE's shared expert, and the attention, each row of a batch mixing
two adapters and the base model with its own (kvserve.lora.targets, kvserve.lora.weights).
What cannot be adapted is refused by name."""

from __future__ import annotations

import copy
import itertools
import json

import peft
import pytest
import torch
from safetensors.torch import save_file

from kvserve import LLM, LoRARequest
from tests.lora.conftest import Adapter, make_adapter
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


PATTERNS = [f"p{i}" for i in range(257)]
REFUSED = {
    "router": (dict(target_modules=["gate"]), "the router (gate)"),
    "router-param": (dict(target_parameters=["mlp.gate.weight"]), "the router (gate)"),
    "shared-gate": (dict(target_modules=["shared_expert_gate"]), "shared_expert_gate"),
    "expert-bias": (dict(target_parameters=["mlp.experts.gate_up_proj_bias"]),
                    "target parameter mlp.experts.gate_up_proj_bias not supported"),
    "bad-pattern": (dict(target_modules=["q_proj"], rank_pattern={"(": 4}), "not a regex"),
    "many-patterns": (dict(target_modules=["q_proj"], alpha_pattern=dict.fromkeys(PATTERNS, 2)),
                      "alpha_pattern has 257 entries (at most 256)"),
    "lm-head": (dict(target_modules=["q_proj", "lm_head"]), "target module lm_head"),
}  # fmt: skip


def test_what_cannot_be_adapted_is_refused_by_name(tmp_path_factory, tmp_path):
    ck = moe_checkpoint(tmp_path_factory, "qwen2_moe")
    llm = moe_llm(ck, num_kv_blocks=16)
    for case, (fields, message) in REFUSED.items():
        request = LoRARequest(case, 1, write_config(tmp_path / case, **fields))
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            llm.generate([PROMPTS[0]], lora_request=request, use_tqdm=False)


def transformers4_adapter(ck, path, names: tuple[str, ...], block: str) -> Adapter:
    """An adapter as PEFT saved them with transformers 4: each expert's projections by name
    (random), and its oracle: peft loading it into the fused experts of transformers 5."""
    config = ck.hf_model.config
    hidden = config.hidden_size
    width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    generator = torch.Generator().manual_seed(9)
    tensors = {}
    sparse = [i for i in range(config.num_hidden_layers)
              if i not in (getattr(config, "mlp_only_layers", None) or [])]  # fmt: skip
    for layer, number, name in itertools.product(sparse, range(experts), names):
        fan_in, fan_out = (width, hidden) if name in ("w2", "down_proj") else (hidden, width)
        key = f"base_model.model.model.layers.{layer}.{block}.experts.{number}.{name}"
        tensors[f"{key}.lora_A.weight"] = torch.randn(2, fan_in, generator=generator) * 0.3
        tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, 2, generator=generator) * 0.3
    path.mkdir()
    save_file(tensors, path / "adapter_model.safetensors")
    config_json = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": list(names),
                   "task_type": "CAUSAL_LM"}  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(config_json))
    model = peft.PeftModel.from_pretrained(copy.deepcopy(ck.hf_model), str(path)).eval()
    return Adapter(path, model)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_experts_named_one_by_one_as_transformers_4_saved_them(arch, tmp_path_factory, tmp_path):
    ck = moe_checkpoint(tmp_path_factory, arch)
    names, block = (("w1", "w3", "w2"), "block_sparse_moe") if arch == "mixtral" else (MLP, "mlp")
    adapters = {"v4": transformers4_adapter(ck, tmp_path / "v4", tuple(names), block)}
    assert adapters["v4"].reference(PROMPTS[0], 8) != ck.reference(PROMPTS[0], 8)
    llm = moe_llm(ck, num_kv_blocks=64)
    names = ["v4", None, "v4"]
    assert run(llm, adapters, PROMPTS[:3], names) == expected(ck, adapters, PROMPTS[:3], names)
