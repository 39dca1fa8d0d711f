"""The attention backends' end-to-end oracle: greedy tokens through a backend equal
transformers', with prefix hits."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers

from kvserve import LLM, SamplingParams
from tests._shared import saved_once, shared_dir
from tests.model.attention.attention_steps import BS

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def prompts() -> list[list[int]]:
    """A shared 13-token prefix (hits in the second round), and lengths around blocks."""
    gen = torch.Generator().manual_seed(17)
    shared = torch.randint(3, 300, (13,), generator=gen).tolist()
    rest = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (3, 6, 8, 1)]
    return [shared + rest[0], shared + rest[1], rest[2], rest[3]]


def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """A tiny Llama with the unit tests' head layout: every test meets the same kernels."""
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=320, max_position_embeddings=512,
        attention_bias=True, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        initializer_range=0.2,
    )  # fmt: skip

    def build() -> transformers.PreTrainedModel:
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config).eval()

    def load(path: Path) -> transformers.PreTrainedModel:
        return transformers.LlamaForCausalLM.from_pretrained(path, config=config).eval()

    path = shared_dir(tmp_path_factory) / "llama-flex"
    return Reference(str(path), saved_once(path, build, load))


@dataclass
class Reference:
    """A saved checkpoint and its transformers model, the oracle (as conftest's)."""

    path: str
    hf_model: transformers.PreTrainedModel

    def reference(self, prompt: list[int], new: int) -> list[int]:
        with torch.no_grad():
            out = self.hf_model.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=new, pad_token_id=0
            )
        return out[0, len(prompt) :].tolist()


def two_rounds(ck, backend: str, **options) -> None:
    """Greedy tokens equal transformers' in both rounds; the second one hits the cache."""
    llm = LLM(ck.path, block_size=BS, num_kv_blocks=96, dtype="float32", device="cpu",
              num_threads=1, attention_backend=backend, **options)  # fmt: skip
    assert llm.engine.runner.attention_backend == backend
    expected = [ck.reference(p, GREEDY.max_tokens) for p in prompts()]
    for _ in range(2):
        outputs = llm.generate(prompts(), GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.stats()["prefix_hit_tokens"] > 0
