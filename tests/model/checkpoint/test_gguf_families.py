"""GGUF files of Gemma 3, Phi-3 and Mistral, written as llama.cpp's converter writes them
(tests/model/gguf_files.py), token for token with transformers on the dequantized weights.

- gemma3: six layers (five sliding, window 7, one global), with the settings llama.cpp
  hard-codes for Gemma 3 (query scale 1/sqrt(head_dim), sliding rope base 10000) and the
  converter's stored 1 + weight norms; Q8_0 and Q4_0 weights;
- phi3: the dense Phi-3 checkpoint (fused qkv and gate/up, half of each head rotated,
  longrope factors as tensors); Q8_0;
- mistral: a llama file (q/k rows reordered) with and without a sliding window.

Prompts run through the engine twice (prefix caching, a chunked prefill budget), longer
than the windows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as T

from kvserve import LLM, SamplingParams
from kvserve.model import ModelLoadError
from kvserve.model.checkpoint.config import load_model_config
from kvserve.model.checkpoint.gguf_config import ARCHITECTURES
from kvserve.model.quant.quant_linear import Int4Linear
from tests.conftest import COMMON
from tests.model.dense_archs import DENSE_ARCHS
from tests.model.gguf_files import greedy, reference_model, write_gguf
from tests.model.quant.test_quantization import (
    assert_runs_its_packed_weights,
    logits_of,
    runner_for,
)

NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def prompt(length: int, salt: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(5000 + 100 * salt + length)
    return torch.randint(3, 300, (length,), generator=gen).tolist()


SHARED = prompt(13, salt=1)
PROMPTS = [[*SHARED, *prompt(5, salt=2)], [*SHARED, *prompt(2, salt=3)], prompt(3)]


def tiny(config_cls, model_cls, **extra):
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**COMMON, **extra})).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and config_cls is transformers.Gemma3TextConfig:
                param.normal_(0.0, 0.5)  # Gemma's norms start at zero: random ones bite
    return model


def gemma3():
    return tiny(
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        num_hidden_layers=6,
        head_dim=16,
        sliding_window=7,
        query_pre_attn_scalar=16,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 50_000.0},
        },
        final_logit_softcapping=10.0,
        attn_implementation="eager",
        initializer_range=0.02,
    )


def dense(arch: str, **changes):
    config_cls, model_cls, extra, _ = DENSE_ARCHS[arch]
    return tiny(config_cls, model_cls, **{**extra, **changes})


def assert_round_trip(model, path: Path, types, **llm_options) -> LLM:
    oracle = reference_model(model, write_gguf(model, path, types))
    expected = [greedy(oracle, p, NEW) for p in PROMPTS]
    assert len(set(expected[0])) > 4, "a degenerate reference proves nothing"
    options = dict(block_size=4, num_kv_blocks=96, dtype="float32", num_threads=1)
    llm = LLM(str(path), max_num_batched_tokens=9, **{**options, **llm_options})
    for _ in range(2):  # the second round hits the first one's blocks
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.stats()["prefix_hit_tokens"] > 0
    return llm


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0], ids=["q8_0", "q4_0"])
def test_gemma3(tmp_path, qtype):
    path = tmp_path / "gemma3.gguf"
    llm = assert_round_trip(gemma3(), path, qtype)
    config = load_model_config(path)
    assert config.layer_windows == [7] * 5 + [None]
    assert llm.engine.runner.model.final_softcap == 10.0


def test_phi3(tmp_path):
    path = tmp_path / "phi3.gguf"
    assert_round_trip(dense("phi3"), path, T.Q8_0)
    config = load_model_config(path)
    assert (config.rotary_dim, config.rope.scaling_type) == (8, "longrope")


@pytest.mark.parametrize("window", [5, None], ids=["window", "no-window"])
def test_mistral_as_a_llama_file(tmp_path, window):
    path = tmp_path / "mistral.gguf"
    assert_round_trip(dense("mistral", sliding_window=window), path, T.F16)
    config = load_model_config(path)
    expected = "MistralForCausalLM" if window else "LlamaForCausalLM"
    assert (config.architecture, config.layer_windows) == (expected, [window] * 2 if window else [])


def test_an_unsupported_architecture_lists_exactly_those_kvserve_runs(tmp_path):
    path = tmp_path / "gpt2.gguf"
    write_gguf(dense("mistral"), path, T.F16, arch="gpt2")
    with pytest.raises(ModelLoadError) as info:
        load_model_config(path)
    supported = ", ".join(ARCHITECTURES)
    assert str(info.value) == f"GGUF architecture 'gpt2' is not supported; supported: {supported}"
    assert {"gemma3", "llama", "phi3", "qwen2", "qwen3"} <= set(ARCHITECTURES)


@pytest.mark.parametrize("arch", ["gemma3", "phi3"])
def test_gguf_mode_keeps_the_4bit_blocks(tmp_path, arch):
    """quantization='gguf': Q4_0 blocks go to the int4 kernel as they are (Phi-3's stored
    fused qkv and gate/up too; Gemma's k and v, too short to stack, one by one), and the
    model runs its packed weights (test_quantization.py's bounds against the same file
    dequantized)."""
    path = tmp_path / f"{arch}.gguf"
    write_gguf(gemma3() if arch == "gemma3" else dense("phi3"), path, T.Q4_0)
    reference = logits_of(runner_for(path))
    runner = runner_for(path, "gguf")
    for layer in runner.model.model.layers:  # Gemma's 32-row k and v run side by side
        modules = list(layer.modules())
        assert not any(isinstance(m, torch.nn.Linear) for m in modules), arch
        assert sum(isinstance(m, Int4Linear) for m in modules) >= 4, arch
    assert_runs_its_packed_weights(runner, reference, "int4")
