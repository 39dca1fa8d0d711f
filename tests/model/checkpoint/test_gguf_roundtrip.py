"""GGUF round trips: tiny checkpoints written as llama.cpp writes them, run token for token.

Each file is written from a transformers model by tests/model/gguf_files.py
(q/k rows permuted as llama.cpp's converter does, Llama 3 rope as
rope_freqs, 2-D tensors in the type under test). The oracle is transformers
on the dequantized weights, so quantization error is no excuse: kvserve's
greedy tokens must equal the oracle's exactly. transformers' own GGUF loader
is a second, independent oracle where it handles the model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as T

from kvserve.model import ModelRunner
from tests.model.gguf_files import greedy, reference_model, transformers_gguf_model, write_gguf
from tests.model.model_driver import NEW, generate, prompt

PROMPTS = [prompt(5, salt=11), prompt(13, salt=11)]
LEGACY_MIX = (T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)
K_MIX = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)


def runner_for(path: Path) -> ModelRunner:
    return ModelRunner(
        path, block_size=4, num_blocks=64, device="cpu", dtype="float32", num_threads=1
    )


def assert_round_trip(model, path: Path, types) -> ModelRunner:
    """Write `model` in `types`, run it, and compare with transformers on the same weights."""
    oracle = reference_model(model, write_gguf(model, path, types))
    expected = [greedy(oracle, p, NEW) for p in PROMPTS]
    assert len(set(expected[1])) > 3, "a degenerate reference proves nothing"
    runner = runner_for(path)
    assert generate(runner, PROMPTS, NEW) == expected
    return runner


def mixed(types: tuple[T, ...]):
    """A different type for each kind of tensor, as llama.cpp's mixes (Q4_K_M, ...) do."""
    return lambda name: types[sum(map(ord, name.split(".")[-2])) % len(types)]


@pytest.mark.parametrize(
    ("arch", "qtype"),
    [
        ("llama", T.F32),
        ("llama", T.F16),
        ("llama", T.Q8_0),
        ("llama", T.Q4_0),
        ("qwen3", T.F16),
        ("qwen3", T.Q8_0),
        ("qwen3", T.Q4_0),
        ("qwen2", T.BF16),
    ],
    ids=lambda v: getattr(v, "name", v),
)
def test_float_and_legacy_types_match_transformers(checkpoints, tmp_path, arch, qtype):
    """Llama: q/k rows and biases permuted, head_dim != hidden / heads, Llama 3 rope;
    Qwen3: q/k norms; Qwen2: tied embeddings, q/k/v biases, rope_theta 1e6."""
    runner = assert_round_trip(checkpoints[arch].hf_model, tmp_path / "m.gguf", qtype)
    hf_config = checkpoints[arch].hf_model.config
    assert runner.config.tie_word_embeddings == hf_config.tie_word_embeddings
    assert (runner.model.lm_head is None) == hf_config.tie_word_embeddings


def test_every_legacy_type_in_one_file(checkpoints, tmp_path):
    assert_round_trip(checkpoints["llama"].hf_model, tmp_path / "m.gguf", mixed(LEGACY_MIX))


@pytest.fixture(scope="module")
def wide_llama(checkpoints) -> transformers.LlamaForCausalLM:
    """The tiny Llama with rows of 256 (K-quant super-blocks) in every projection, and what
    transformers' GGUF config reads: no biases, plain rope."""
    config = transformers.LlamaConfig.from_dict(
        {
            **checkpoints["llama"].hf_model.config.to_dict(),
            "hidden_size": 256,
            "intermediate_size": 512,
            "head_dim": 64,
            "attention_bias": False,
            "mlp_bias": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        }
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("types", [T.Q4_K, T.Q6_K, K_MIX], ids=["Q4_K", "Q6_K", "mixed"])
def test_k_quants_match_transformers(wide_llama, tmp_path, types):
    choice = mixed(types) if isinstance(types, tuple) else types
    assert_round_trip(wide_llama, tmp_path / "m.gguf", choice)


@pytest.mark.parametrize("case", ["llama-Q4_K", "qwen2-Q8_0"])
def test_transformers_gguf_loader_agrees(checkpoints, wide_llama, tmp_path, case):
    """transformers reads the same files (its own names, dequantization and q/k un-permutation)
    to the same tokens: the writer's conventions are llama.cpp's, not just kvserve's.

    (Not the tiny Qwen3 or Llama: transformers' GGUF config ignores their explicit head_dim,
    Llama's biases and rope_freqs.)"""
    if case.startswith("llama"):
        model, qtype = wide_llama, T.Q4_K
    else:
        model, qtype = checkpoints["qwen2"].hf_model, T.Q8_0
    path = tmp_path / "m.gguf"
    write_gguf(model, path, qtype)
    oracle = transformers_gguf_model(path)
    expected = [greedy(oracle, p, NEW) for p in PROMPTS]
    assert generate(runner_for(path), PROMPTS, NEW) == expected
