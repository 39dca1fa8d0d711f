"""Tiny mixture-of-experts checkpoints written by transformers, and their oracle.

One per family kvserve runs: Qwen3-MoE (top-k renormalised, a dense layer in
`mlp_only_layers`), Qwen2-MoE (a shared expert beside the routed ones, q/k/v
biases), Mixtral (`block_sparse_moe`, w1/w3/w2 experts), OLMoE (q/k norms over
whole projections, `clip_qkv`, top-k weights not renormalised). Eight
experts, two per token: a prompt of a few tokens leaves most experts without
any, a longer one reaches all of them. Saved once per test run like conftest's
checkpoints (tests/_shared.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import transformers

from tests._shared import saved_once, shared_dir
from tests.conftest import COMMON

TINY = {
    **{k: v for k, v in COMMON.items() if k not in ("intermediate_size", "num_hidden_layers")},
    "num_experts_per_tok": 2,
}
"""The suite's tiny shape (conftest's COMMON); each family sets its layers and widths."""

MOE_ARCHS = {
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(
            num_hidden_layers=3,
            head_dim=16,
            intermediate_size=96,  # the dense layer's MLP
            moe_intermediate_size=64,  # int4 rows fill the kernel's blocks
            num_experts=8,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        ),
    ),
    "qwen2_moe": (
        transformers.Qwen2MoeConfig,
        transformers.Qwen2MoeForCausalLM,
        dict(
            num_hidden_layers=2,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            num_experts=8,
            norm_topk_prob=False,
            tie_word_embeddings=False,
        ),
    ),
    "mixtral": (
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        dict(num_hidden_layers=2, intermediate_size=64, num_local_experts=8),  # packable widths
    ),
    "olmoe": (
        transformers.OlmoeConfig,
        transformers.OlmoeForCausalLM,
        dict(
            num_hidden_layers=2,
            intermediate_size=32,
            num_experts=8,
            clip_qkv=2.0,
            norm_topk_prob=False,
        ),
    ),
}


@dataclass
class MoeCheckpoint:
    """A saved tiny MoE model and its transformers twin (the oracle), as conftest's."""

    arch: str
    path: str
    hf_model: transformers.PreTrainedModel
    _reference: dict = field(default_factory=dict)

    def reference(self, prompt: list[int], new: int) -> list[int]:
        key = (tuple(prompt), new)
        if key not in self._reference:
            with torch.no_grad():
                out = self.hf_model.generate(
                    torch.tensor([prompt]), do_sample=False, max_new_tokens=new, pad_token_id=0
                )
            self._reference[key] = out[0, len(prompt) :].tolist()
        return self._reference[key]


def moe_config(arch: str) -> transformers.PretrainedConfig:
    config_cls, _, extra = MOE_ARCHS[arch]
    return config_cls(**{**TINY, **extra})


def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory, arch: str) -> MoeCheckpoint:
    """The run's one checkpoint of `arch` (read-only)."""
    path = shared_dir(tmp_path_factory) / f"checkpoint-{arch}"
    return MoeCheckpoint(arch, str(path), saved_moe_checkpoint(arch, path))


def saved_moe_checkpoint(arch: str, path: Path) -> transformers.PreTrainedModel:
    """`arch`'s tiny model, saved at `path` once (tests/_shared.py), and its oracle."""
    _, model_cls, _ = MOE_ARCHS[arch]
    config = moe_config(arch)

    def build() -> transformers.PreTrainedModel:
        torch.manual_seed(0)
        return model_cls(config).eval()

    def load(saved: Path) -> transformers.PreTrainedModel:
        return model_cls.from_pretrained(saved, config=config).eval()

    return saved_once(path, build, load)
