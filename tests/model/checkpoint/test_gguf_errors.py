"""Bad GGUF files and paths: each is one clear line that names the problem, and nothing is built.

Every case raises ModelLoadError before the KV cache is allocated (the
runner's allocation is replaced by a tripwire in `load`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from kvserve.model import ModelLoadError, ModelRunner, load_model
from kvserve.model import runner as runner_module
from tests.model.gguf_files import write_gguf


@pytest.fixture
def qwen3(checkpoints):
    return checkpoints["qwen3"].hf_model


def load(path: Path, monkeypatch: pytest.MonkeyPatch) -> ModelRunner:
    def tripwire(*args, **kwargs):
        raise AssertionError("the KV cache was allocated for a checkpoint that cannot load")

    monkeypatch.setattr(runner_module, "allocate_kv_caches", tripwire)
    return ModelRunner(path, block_size=4, num_blocks=8, device="cpu", num_threads=1)


def refused(path: Path, monkeypatch: pytest.MonkeyPatch, pattern: str) -> str:
    with pytest.raises(ModelLoadError, match=pattern) as info:
        load(path, monkeypatch)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_a_file_that_is_not_gguf(tmp_path, monkeypatch):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 a zip file, not a model")
    refused(path, monkeypatch, r"model\.gguf is not a GGUF file")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    refused(empty, monkeypatch, "not a GGUF file")


@pytest.mark.parametrize("keep", [0.5, 0.99, 40], ids=["half", "last-bytes", "header"])
def test_a_truncated_file(qwen3, tmp_path, monkeypatch, keep):
    path = tmp_path / "model.gguf"
    write_gguf(qwen3, path, T.Q8_0)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep) if keep < 1 else keep])
    refused(path, monkeypatch, "is truncated")


def test_an_unsupported_architecture_is_named_with_the_supported_ones(qwen3, tmp_path, monkeypatch):
    path = tmp_path / "model.gguf"
    write_gguf(qwen3, path, T.F16, arch="gpt2")
    refused(
        path,
        monkeypatch,
        r"architecture 'gpt2' is not supported; supported: gemma3, llama, phi3, qwen2",
    )


def test_an_unsupported_tensor_type_names_type_and_tensor(qwen3, tmp_path, monkeypatch):
    path = tmp_path / "model.gguf"
    write_gguf(qwen3, path, lambda name: T.F64 if name == "blk.1.ffn_up.weight" else T.F16)
    refused(path, monkeypatch, r"tensor blk\.1\.ffn_up\.weight has type F64.*supported types: F32")


def test_a_sharded_model_is_refused_as_sharded(qwen3, tmp_path, monkeypatch):
    write_gguf(qwen3, tmp_path / "model.gguf", T.F16, split_max_tensors=20)
    shards = sorted(tmp_path.glob("*.gguf"))
    assert shards[0].name == "model-00001-of-00002.gguf"
    refused(shards[0], monkeypatch, r"model-00001-of-00002\.gguf is one shard of a sharded GGUF")
    refused(tmp_path, monkeypatch, r"holds a sharded GGUF model.*only single-file GGUF")
    # A shard under another name: its metadata says so.
    lone = tmp_path / "lone" / "whole.gguf"
    lone.parent.mkdir()
    shards[0].rename(lone)
    refused(lone, monkeypatch, r"one of 2 shards of a sharded GGUF model.*single-file")


def test_a_directory_needs_exactly_one_gguf_file(qwen3, tmp_path, monkeypatch):
    refused(tmp_path, monkeypatch, r"config\.json not found in .*no \.gguf file")
    write_gguf(qwen3, tmp_path / "a.gguf", T.F16)
    write_gguf(qwen3, tmp_path / "b.gguf", T.Q8_0)
    refused(tmp_path, monkeypatch, r"holds 2 \.gguf files \(a\.gguf, b\.gguf\)")
    refused(tmp_path / "c.gguf", monkeypatch, r"c\.gguf' does not exist")


def test_rope_scaling_kvserve_cannot_run_is_refused_by_name(qwen3, tmp_path, monkeypatch):
    def yarn(writer):
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)
        writer.add_rope_scaling_orig_ctx_len(128)

    path = tmp_path / "model.gguf"
    write_gguf(qwen3, path, T.F16, extra=yarn)
    refused(path, monkeypatch, r"rope scaling type 'yarn' is not supported")


def test_rope_freqs_that_are_not_llama3_scaling_are_refused(qwen3, tmp_path, monkeypatch):
    def odd_freqs(writer):
        divisors = np.linspace(3.0, 1.0, qwen3.config.head_dim // 2, dtype=np.float32)
        writer.add_tensor("rope_freqs.weight", divisors)

    path = tmp_path / "model.gguf"
    write_gguf(qwen3, path, T.F16, extra=odd_freqs)
    refused(path, monkeypatch, r"rope_freqs\.weight .* not Llama 3 scaling")


def test_foreign_tensors_are_named(qwen3, tmp_path, monkeypatch):
    def fused(writer):
        writer.add_tensor("blk.0.attn_qkv.weight", np.zeros((8, 64), dtype=np.float32))

    path = tmp_path / "model.gguf"
    write_gguf(qwen3, path, T.F16, extra=fused)
    refused(path, monkeypatch, r"unexpected tensors: blk\.0\.attn_qkv\.weight")


def test_an_hf_directory_with_a_gguf_file_beside_it_stays_hf(checkpoints, tmp_path):
    path = tmp_path / "hf"
    shutil.copytree(checkpoints["qwen3"].path, path)
    (path / "stray.gguf").write_bytes(b"not even GGUF")
    _, config = load_model(path, torch.float32, torch.device("cpu"))
    assert config.architecture == "Qwen3ForCausalLM"
