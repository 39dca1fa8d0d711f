"""Checkpoint loading: the supported layouts load, everything else fails with a clear error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve.model import ModelLoadError, ModelRunner, load_model, load_model_config
from kvserve.model.loader import weight_files
from tests.model.model_driver import make_chunk
from tests.model.stacked_state import stacked_state

CPU = torch.device("cpu")


def copy(checkpoints, arch: str, tmp_path: Path) -> Path:
    dst = tmp_path / arch
    shutil.copytree(checkpoints[arch].path, dst)
    return dst


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def edit_weights(path: Path, change) -> None:
    file = path / "model.safetensors"
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def load(path: Path):
    return load_model(path, torch.float32, CPU)


def test_layouts_of_the_fixtures(checkpoints):
    """The fixtures really cover sharded, tied and untied checkpoints."""
    qwen2 = Path(checkpoints["qwen2"].path)
    assert (qwen2 / "model.safetensors.index.json").exists()
    assert len(weight_files(qwen2)) > 1
    model, config = load(qwen2)
    assert config.tie_word_embeddings and model.lm_head is None
    model, config = load(Path(checkpoints["llama"].path))
    assert not config.tie_word_embeddings and model.lm_head is not None
    assert config.head_dim == 32 and config.rope.scaling_type == "llama3"
    assert load_model_config(qwen2).rope.theta == 1_000_000.0


def test_weights_match_transformers_exactly(checkpoints):
    """Every weight by name, q/k/v and gate/up stacked as the loader stacks them."""
    ck = checkpoints["qwen3"]
    model, _ = load(Path(ck.path))
    ours = model.state_dict()
    expected = stacked_state(ck.hf_model.state_dict())
    assert ours.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(ours[name], tensor), name


def test_tied_checkpoint_that_also_stores_lm_head_loads(checkpoints, tmp_path):
    path = copy(checkpoints, "qwen3", tmp_path)
    edit_config(path, tie_word_embeddings=True)
    model, _ = load(path)
    assert model.lm_head is None


def test_unsupported_architecture_names_the_supported_ones(checkpoints, tmp_path):
    path = copy(checkpoints, "llama", tmp_path)
    edit_config(path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3"):
        load(path)


def test_missing_directory_config_and_weights(checkpoints, tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load(tmp_path / "nowhere")
    path = copy(checkpoints, "llama", tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        load(path)
    (path / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json not found"):
        load(path)


def test_missing_shard(checkpoints, tmp_path):
    path = copy(checkpoints, "qwen2", tmp_path)
    victim = sorted(path.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(ModelLoadError, match=victim.name):
        load(path)


def test_renamed_tensor_is_named_as_missing_and_unexpected(checkpoints, tmp_path):
    path = copy(checkpoints, "llama", tmp_path)
    name = "model.layers.1.self_attn.k_proj.weight"
    edit_weights(path, lambda t: t.__setitem__("model.layers.1.attn.k.weight", t.pop(name)))
    with pytest.raises(ModelLoadError, match=rf"missing tensors: {name}.*unexpected.*attn\.k\."):
        load(path)


def test_missing_tensor_is_named(checkpoints, tmp_path):
    path = copy(checkpoints, "llama", tmp_path)
    edit_weights(path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ModelLoadError, match=r"missing tensors: lm_head\.weight"):
        load(path)


def test_wrong_shape_is_named(checkpoints, tmp_path):
    path = copy(checkpoints, "qwen3", tmp_path)
    name = "model.layers.0.mlp.up_proj.weight"
    edit_weights(path, lambda t: t.__setitem__(name, torch.zeros(3, 3)))
    with pytest.raises(ModelLoadError, match=rf"wrong shapes: {name}: checkpoint \(3, 3\)"):
        load(path)


def test_config_shape_mismatch_is_reported_as_weights_error(checkpoints, tmp_path):
    path = copy(checkpoints, "qwen3", tmp_path)
    edit_config(path, intermediate_size=96)
    with pytest.raises(ModelLoadError, match=r"wrong shapes: .*mlp"):
        load(path)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "yarn.*supported"),
        ({"layer_types": ["sliding_attention", "full_attention", "full_attention"]}, "sliding"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_attention_heads": None}, "num_attention_heads"),
        ({"architectures": []}, "architectures"),
    ],
)
def test_unsupported_configs(checkpoints, tmp_path, changes, message):
    path = copy(checkpoints, "qwen3", tmp_path)
    edit_config(path, **changes)
    with pytest.raises(ModelLoadError, match=message):
        load(path)


def test_old_style_rope_fields_are_read(checkpoints, tmp_path):
    """transformers 4 spelled rope as `rope_theta` + `rope_scaling` with `type`."""
    path = copy(checkpoints, "llama", tmp_path)
    config = json.loads((path / "config.json").read_text())
    params = config.pop("rope_parameters")
    theta = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    config.update(rope_theta=theta, rope_scaling=params)
    (path / "config.json").write_text(json.dumps(config))
    new = load_model_config(Path(checkpoints["llama"].path)).rope
    assert load_model_config(path).rope == new


def test_generation_config_eos_ids_are_honoured(checkpoints, tmp_path):
    path = copy(checkpoints, "qwen3", tmp_path)
    edit_config(path, eos_token_id=5)
    assert load_model_config(path).eos_token_ids == {5}
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert load_model_config(path).eos_token_ids == {7, 9}
    runner = ModelRunner(path, block_size=4, num_blocks=8, num_threads=1)
    assert runner.eos_token_ids == {7, 9}
    assert runner.max_model_len == 512
    assert runner.tokenizer is None  # the tiny fixtures have no tokenizer


def test_bfloat16_runs(checkpoints):
    runner = ModelRunner(
        checkpoints["qwen3"].path, block_size=4, num_blocks=8, dtype="bfloat16", num_threads=1
    )
    assert runner.kv_caches[0][0].dtype == torch.bfloat16
    (token,) = runner.execute([make_chunk("b", [1, 2, 3, 4, 5], 0, [[1, 2]])]).tokens
    assert 0 <= token < runner.vocab_size
    with pytest.raises(ValueError, match="dtype"):
        ModelRunner(checkpoints["qwen3"].path, block_size=4, num_blocks=8, dtype="fp8")
