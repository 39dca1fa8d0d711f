"""On a CPU without native bfloat16 (issue 43) `dtype="auto"` is float32: an engine
built there generates transformers' greedy tokens exactly."""

from __future__ import annotations

import torch

from kvserve import LLM, SamplingParams
from kvserve.model.cpu_kernels.cpu_features import ENV

NEW = 12


def prompt(length: int, salt: int) -> list[int]:
    gen = torch.Generator().manual_seed(4300 + 100 * salt + length)
    return torch.randint(3, 300, (length,), generator=gen).tolist()


def test_auto_on_an_avx2_only_cpu_is_float32_and_token_exact(checkpoints, monkeypatch):
    monkeypatch.setenv(ENV, "avx2")
    ck = checkpoints["llama"]
    llm = LLM(ck.path, block_size=4, num_kv_blocks=64, device="cpu", num_threads=1)
    runner = llm.engine.runner
    assert runner.dtype == torch.float32
    prompts = [prompt(5, 0), prompt(9, 1), prompt(9, 1)]
    greedy = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [ck.reference(p, NEW) for p in prompts]
