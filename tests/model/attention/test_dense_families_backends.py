"""The triton backend end to end on Gemma 2: soft-capped scores over alternating sliding
and global layers, a prefill chunked past the window, token for token with transformers.

Mistral's and Phi-3's attention differ from Llama's only in what the plain path checks
(tests/engine/test_dense_families.py): a window on every layer, a partial rotary before
the cache. The flex and triton kernels are checked against the plain path on random
steps with windows and soft-caps (test_flex_attention.py, test_triton_attention.py);
flex's end-to-end run of one more model costs a compile of ~10 s, so it is not repeated
here. The interpreter is slow: one short round.
"""

from __future__ import annotations

import torch

from kvserve import LLM, SamplingParams


def test_gemma2_triton_equals_transformers(dense_checkpoints):
    ck = dense_checkpoints["gemma2"]
    gen = torch.Generator().manual_seed(23)
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (11, 2)]
    llm = LLM(ck.path, block_size=4, num_kv_blocks=32, dtype="float32", device="cpu",
              num_threads=1, attention_backend="triton", max_num_batched_tokens=7)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [ck.reference(p, 6) for p in prompts]
