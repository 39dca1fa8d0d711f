"""The GGUF reader's parts on their own: q/k rows, Llama 3 rope recovery, paths, copies."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader

from kvserve.model.checkpoint.config import RopeConfig
from kvserve.model.checkpoint.errors import ModelLoadError
from kvserve.model.checkpoint.gguf_rope import llama3_from_divisors
from kvserve.model.checkpoint.gguf_weights import dequantized, model_name, unpermute_rows
from kvserve.model.checkpoint.resolve import resolve_checkpoint
from kvserve.model.layers.common import rope_inv_freq
from tests.model.gguf_files import converter_permute, llama3_rope_freqs, write_gguf


@pytest.mark.parametrize(("heads", "head_dim", "columns"), [(4, 32, 64), (2, 64, 1), (9, 64, 0)])
def test_unpermute_undoes_the_converters_permutation(heads, head_dim, columns):
    shape = (heads * head_dim, columns) if columns else (heads * head_dim,)
    weights = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    permuted = converter_permute(weights, heads)
    assert not np.array_equal(permuted, weights)
    assert np.array_equal(unpermute_rows(permuted, heads), weights)


def test_unpermute_refuses_rows_that_do_not_split():
    with pytest.raises(ModelLoadError, match="do not split"):
        unpermute_rows(np.zeros((10, 4)), 4)


LLAMA3_CASES = [
    # theta, head_dim, factor, low_freq_factor, high_freq_factor, original context
    (500_000.0, 128, 8.0, 1.0, 4.0, 8192),  # Llama 3.1 / 3.2: six frequencies in the band
    (500_000.0, 64, 32.0, 1.0, 4.0, 8192),  # Llama 3.2 1B/3B's factor
    (10_000.0, 32, 8.0, 1.0, 4.0, 64),  # the tiny test Llama
    (10_000.0, 16, 4.0, 1.0, 2.0, 100),  # one frequency in the band
    (10_000.0, 8, 4.0, 1.0, 1.05, 100),  # none in the band: a step
]


@pytest.mark.parametrize("case", LLAMA3_CASES, ids=lambda c: f"d{c[1]}-f{c[2]}-L{c[5]}")
def test_llama3_rope_is_recovered_from_rope_freqs(case):
    """Recovered parameters give kvserve the rotary frequencies the original ones give."""
    theta, head_dim, factor, low, high, original = case
    rope = dict(rope_theta=theta, factor=factor, low_freq_factor=low, high_freq_factor=high)
    rope["original_max_position_embeddings"] = original
    divisors = llama3_rope_freqs(rope, head_dim).astype(np.float64)
    params = llama3_from_divisors(divisors, theta, head_dim)
    assert params["rope_type"] == "llama3" and params["factor"] == pytest.approx(factor)
    fields = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    recovered = RopeConfig(theta, "llama3", *(params[k] for k in fields))
    truth = RopeConfig(theta, "llama3", factor, low, high, original)
    cpu = torch.device("cpu")
    expected = rope_inv_freq(truth, head_dim, cpu)
    torch.testing.assert_close(rope_inv_freq(recovered, head_dim, cpu), expected, rtol=1e-5, atol=0)
    # And llama.cpp's own reading of the file: base frequency / divisor.
    plain = theta ** -(np.arange(0, head_dim, 2) / head_dim)
    np.testing.assert_allclose(expected.numpy(), plain / divisors, rtol=1e-5)


def test_rope_freqs_of_ones_are_plain_rope():
    assert llama3_from_divisors(np.ones(16), 10_000.0, 32) is None


def test_rope_freqs_of_the_wrong_length_are_refused():
    with pytest.raises(ModelLoadError, match="8 entries; head_dim 32 needs 16"):
        llama3_from_divisors(np.full(8, 2.0), 10_000.0, 32)


def test_names_follow_transformers():
    assert model_name("blk.3.attn_k.bias") == "model.layers.3.self_attn.k_proj.bias"
    assert model_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert model_name("output.weight") == "lm_head.weight"
    assert model_name("blk.0.attn_qkv.weight") is None
    assert model_name("rope_freqs.weight") is None


def test_f32_tensors_are_copied_out_of_the_memory_map(checkpoints, tmp_path):
    """The model must own its weights: a view of the file would pin the mapping."""
    path = tmp_path / "m.gguf"
    write_gguf(checkpoints["qwen3"].hf_model, path, T.F32)
    reader = GGUFReader(path)
    tensor = next(t for t in reader.tensors if t.name == "token_embd.weight")
    array = dequantized(tensor, reader)
    assert array.dtype == np.float32 and array.shape == (320, 64)
    assert not np.may_share_memory(array, reader.data)


def test_resolution(tmp_path):
    single = tmp_path / "whole-00001-of-00001.gguf"
    single.write_bytes(b"GGUF")
    assert resolve_checkpoint(single).gguf == single  # one of one is a whole model
    assert resolve_checkpoint(tmp_path) == resolve_checkpoint(single)
    assert resolve_checkpoint(tmp_path).directory == tmp_path
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert resolve_checkpoint(tmp_path).gguf is None
