"""GGUF mixture-of-experts files written as llama.cpp's converter writes them, run token for token.

Qwen3-MoE as `qwen3moe`, Qwen2-MoE as `qwen2moe` (its shared expert as
`ffn_*_shexp`) and Mixtral as `llama` with experts: each layer's experts
stacked into one tensor per projection (`ffn_gate_exps`, `ffn_up_exps`,
`ffn_down_exps`: [experts, rows, columns]) beside the router (`ffn_gate_inp`),
the expert counts in the metadata, Mixtral's q/k rows permuted. The files are
written by tests/model/gguf_files.py from a stand-in holding the stacked tensors
under the converter's intermediate names (which gguf-py's own name map turns
into llama.cpp's). The oracle is transformers on the dequantized weights.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import gguf
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as T

from kvserve.model import ModelLoadError, ModelRunner
from kvserve.model.quant.quant_linear import Int4Linear, Int8Linear, PackedLinear
from tests.model.gguf_files import greedy, reference_model, write_gguf
from tests.model.model_driver import NEW, generate, prompt
from tests.model.moe_checkpoints import moe_config
from tests.model.quant.test_quantization import assert_runs_its_packed_weights, logits_of
from tests.model.stacked_state import stacked_state

PROMPTS = [prompt(5, salt=12), prompt(13, salt=12)]
EXPERT_PROJECTIONS = {
    # transformers 5's stacked name: the converter's names of its parts (Qwen3-MoE, Mixtral)
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj"), "down_proj"),
    "qwen2_moe": ("mlp", ("gate_proj", "up_proj"), "down_proj"),
    "mixtral": ("block_sparse_moe", ("w1", "w3"), "w2"),
}


def build(arch: str) -> transformers.PreTrainedModel:
    """The tiny checkpoint's model, every layer sparse (llama.cpp's qwen3moe has no dense
    ones)."""
    config = moe_config(arch)
    config.mlp_only_layers = []
    torch.manual_seed(1)
    model_cls = {
        "qwen3_moe": transformers.Qwen3MoeForCausalLM,
        "qwen2_moe": transformers.Qwen2MoeForCausalLM,
    }.get(arch, transformers.MixtralForCausalLM)
    return model_cls(config).eval()


def converter_view(model: transformers.PreTrainedModel) -> SimpleNamespace:
    """What llama.cpp's converter stacks from a checkpoint: per layer one [experts, rows,
    columns] tensor per projection under `...experts.<part>.weight`, the router under
    `...gate.weight`; a config that write_gguf reads (Mixtral is written as llama)."""
    config = model.config
    block, (gate_name, up_name), down_name = EXPERT_PROJECTIONS[config.model_type]
    state = {}
    for name, tensor in model.state_dict().items():
        prefix, _, rest = name.partition(".mlp.")
        if rest == "experts.gate_up_proj":
            gate, up = tensor.chunk(2, dim=1)
            state[f"{prefix}.{block}.experts.{gate_name}.weight"] = gate
            state[f"{prefix}.{block}.experts.{up_name}.weight"] = up
        elif rest == "experts.down_proj":
            state[f"{prefix}.{block}.experts.{down_name}.weight"] = tensor
        elif rest == "gate.weight":
            state[f"{prefix}.{block}.gate.weight"] = tensor
        elif rest == "shared_expert_gate.weight":
            state[name] = tensor[0]  # one row, written 1-D as llama.cpp declares it
        else:
            state[name] = tensor
    model_type = "llama" if config.model_type == "mixtral" else config.model_type
    width = getattr(config, "moe_intermediate_size", config.intermediate_size)
    fields = {k: getattr(config, k) for k in ("num_attention_heads", "num_key_value_heads",
              "hidden_size", "rope_parameters", "num_hidden_layers", "max_position_embeddings",
              "rms_norm_eps", "vocab_size", "tie_word_embeddings")}  # fmt: skip
    view_config = SimpleNamespace(
        **fields, model_type=model_type, head_dim=getattr(config, "head_dim", None),
        intermediate_size=config.intermediate_size,
        experts=getattr(config, "num_local_experts", None) or config.num_experts,
        used=config.num_experts_per_tok, width=width,
        shared_width=getattr(config, "shared_expert_intermediate_size", 0),
    )  # fmt: skip
    return SimpleNamespace(config=view_config, state_dict=lambda: state)


def write_moe_gguf(model, path: Path, types, extra=None) -> dict[str, torch.Tensor]:
    """The file, and transformers' state dict of what it decodes to; `extra` replaces the
    expert metadata (a broken file)."""
    view = converter_view(model)
    config = view.config

    def experts(writer: gguf.GGUFWriter) -> None:
        writer.add_expert_count(config.experts)
        writer.add_expert_used_count(config.used)
        if config.model_type != "llama":
            writer.add_expert_feed_forward_length(config.width)
        if config.model_type == "qwen2_moe":
            writer.add_expert_shared_feed_forward_length(config.shared_width)

    decoded = write_gguf(view, path, types, extra=extra or experts)
    block, (gate_name, up_name), down_name = EXPERT_PROJECTIONS[model.config.model_type]
    reference = {}
    for name in model.state_dict():
        prefix, _, rest = name.partition(".mlp.")
        parts = f"{prefix}.{block}"
        if rest == "experts.gate_up_proj":
            pair = (decoded[f"{parts}.experts.{n}.weight"] for n in (gate_name, up_name))
            reference[name] = torch.cat(tuple(pair), dim=1)
        elif rest == "experts.down_proj":
            reference[name] = decoded[f"{parts}.experts.{down_name}.weight"]
        elif rest == "gate.weight":
            reference[name] = decoded[f"{parts}.gate.weight"]
        elif rest == "shared_expert_gate.weight":
            reference[name] = decoded[name][None]
        elif name in decoded:
            reference[name] = decoded[name]
    return reference


def router_in_f32(qtype: T):
    """llama.cpp's quantize keeps the router (ffn_gate_inp) in float."""
    return lambda name: T.F32 if "ffn_gate_inp" in name else qtype


def runner_for(path: Path, quantization: str = "none") -> ModelRunner:
    return ModelRunner(
        path, block_size=4, num_blocks=64, device="cpu", dtype="float32", num_threads=1,
        quantization=quantization,
    )  # fmt: skip


@pytest.fixture(scope="module")
def models() -> dict[str, transformers.PreTrainedModel]:
    return {arch: build(arch) for arch in EXPERT_PROJECTIONS}


@pytest.mark.parametrize(
    ("arch", "qtype"),
    [("qwen3_moe", T.Q8_0), ("qwen2_moe", T.Q4_0), ("mixtral", T.F16), ("mixtral", T.Q4_0)],
    ids=lambda v: getattr(v, "name", v),
)  # fmt: skip
def test_stacked_experts_match_transformers(models, tmp_path, arch, qtype):
    model = models[arch]
    path = tmp_path / "m.gguf"
    oracle = reference_model(model, write_moe_gguf(model, path, router_in_f32(qtype)))
    expected = [greedy(oracle, p, NEW) for p in PROMPTS]
    assert len(set(expected[1])) > 3, "a degenerate reference proves nothing"
    runner = runner_for(path)
    assert runner.config.architecture == type(model).__name__
    assert generate(runner, PROMPTS, NEW) == expected


def test_gguf_mode_requantizes_q8_0_experts_to_int8(models, tmp_path):
    """Q8_0 has no int4 layout: its experts get per-channel int8, like a dense layer's."""
    path = tmp_path / "q8.gguf"
    write_moe_gguf(models["mixtral"], path, router_in_f32(T.Q8_0))
    runner = runner_for(path, "gguf")
    experts = [m for n, m in runner.model.named_modules() if ".experts." in n]
    packed = [m for m in experts if isinstance(m, PackedLinear)]
    assert len(packed) == 2 * 8 * runner.config.num_layers
    assert all(isinstance(m, Int8Linear) for m in packed)
    assert_runs_its_packed_weights(runner, logits_of(runner_for(path)), "int8")


def test_expert_metadata_is_checked_by_name(models, tmp_path):
    path = tmp_path / "m.gguf"
    write_moe_gguf(models["qwen3_moe"], path, T.F32, extra=lambda writer: None)
    with pytest.raises(ModelLoadError, match=r"GGUF qwen3moe file without qwen3moe\.expert_count"):
        runner_for(path)


def test_gguf_mode_keeps_q4_experts_packed(models, tmp_path):
    """Quantization 'gguf': every expert's Q4_0 blocks go to the int4 kernel as they are
    (each packed weight is the file's dequantized one, bit for bit), the router
    stays float, and the model runs near the float one on the same weights."""
    model = models["qwen3_moe"]
    path = tmp_path / "q4.gguf"
    reference = stacked_state(dict(_per_expert(write_moe_gguf(model, path, router_in_f32(T.Q4_0)))))
    runner = runner_for(path, "gguf")
    packed = {n: m for n, m in runner.model.named_modules() if isinstance(m, PackedLinear)}
    experts = [n for n in packed if ".experts." in n]
    assert len(experts) == 2 * 8 * runner.config.num_layers  # gate/up stacked, down
    assert all(isinstance(packed[n], Int4Linear) for n in experts)
    for name in experts:
        expected = reference[f"{name}.weight"]
        assert torch.equal(packed[name].dequantized(), expected), name
    router = runner.model.model.layers[0].mlp.gate
    assert router.weight.dtype == torch.float32
    assert_runs_its_packed_weights(runner, logits_of(runner_for(path)), "int4")


def _per_expert(state: dict[str, torch.Tensor]):
    """transformers 5's stacked expert weights as kvserve's per-expert names."""
    for name, tensor in state.items():
        prefix, _, rest = name.partition(".mlp.experts.")
        if rest == "gate_up_proj":
            for e, weight in enumerate(tensor):
                gate, up = weight.chunk(2, dim=0)
                yield f"{prefix}.mlp.experts.{e}.gate_proj.weight", gate
                yield f"{prefix}.mlp.experts.{e}.up_proj.weight", up
        elif rest == "down_proj":
            for e, weight in enumerate(tensor):
                yield f"{prefix}.mlp.experts.{e}.down_proj.weight", weight
        else:
            yield name, tensor
