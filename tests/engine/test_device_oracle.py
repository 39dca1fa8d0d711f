"""The engine on the test device (CUDA; tests/_device.py): the CPU's oracle tests again.

float32 greedy tokens equal transformers' (run on the CPU) for Llama, Qwen2,
Qwen3, Gemma 3, Bamba, Mistral, Phi-3, Gemma 2 and the mixture-of-experts families
(Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE), with prefix caching (and hits), without it,
with chunked prefill and under preemption; bfloat16 runs end to end with prefix hits.
The prompts, options and checks are those of the CPU tests (test_llm, test_gemma3,
test_bamba_engine, test_dense_families, test_moe_engine, hybrid_rounds); only the
device differs. Each runs on the plain attention backend and on the Triton one, with its
decode CUDA graphs (Bamba: eager, its Mamba layers have none) and without them
(enforce_eager). `KVSERVE_TEST_DEVICE=cpu` runs this file on the CPU (Triton in its
interpreter, no graphs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType

import pytest
import test_bamba_engine
import test_dense_families
import test_gemma3
import test_llm
import test_moe_engine
from _device import DEVICE, exact_float32, needs_device  # noqa: F401 (a fixture)
from hybrid_rounds import MODES, tokens, two_rounds

pytestmark = [needs_device, pytest.mark.usefixtures("exact_float32")]


@dataclass(frozen=True)
class Family:
    tests: ModuleType
    """The CPU test module whose PROMPTS, GREEDY and make(ck, **options) are reused."""
    fixture: str
    """The conftest fixture of its checkpoint(s)."""
    preempt_blocks: int
    """A pool small enough to preempt (the value its CPU test uses)."""


FAMILIES = {
    "llama": Family(test_llm, "checkpoints", 24),
    "qwen2": Family(test_llm, "checkpoints", 24),
    "qwen3": Family(test_llm, "checkpoints", 24),
    "gemma3": Family(test_gemma3, "gemma3_checkpoint", 100),
    "bamba": Family(test_bamba_engine, "bamba_checkpoint", 14),
    **{
        arch: Family(test_moe_engine, "moe_checkpoints", test_moe_engine.PREEMPT_BLOCKS)
        for arch in ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
    },
    # Preemption without a chunked prefill: a pool that holds the longest prompt whole.
    "mistral": Family(test_dense_families, "dense_checkpoints", 12),
    "phi3": Family(test_dense_families, "dense_checkpoints", 20),
    "gemma2": Family(test_dense_families, "dense_checkpoints", 30),
}


_ON_CUDA = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("KVSERVE_TEST_TRITON_ON_CPU") != "1",
    reason="Triton on the CPU is its interpreter, ~45 s a test (KVSERVE_TEST_TRITON_ON_CPU=1 "
    "runs them); tests/model/attention/test_triton_attention.py checks its kernels on the CPU",
)
BACKENDS = {
    "plain": {},
    "triton-graphs": {"attention_backend": "triton"},
    "triton-eager": {"attention_backend": "triton", "enforce_eager": True},
}
BACKEND_PARAMS = [
    pytest.param(name, marks=() if name == "plain" else _ON_CUDA) for name in BACKENDS
]


def checkpoint(arch: str, request: pytest.FixtureRequest):
    """The session checkpoint of `arch`, built only when a test asks for it."""
    found = request.getfixturevalue(FAMILIES[arch].fixture)
    return found[arch] if isinstance(found, dict) else found


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", list(FAMILIES))
def test_float32_greedy_equals_transformers(arch, mode, backend, request):
    family, ck = FAMILIES[arch], checkpoint(arch, request)
    options = dict(MODES[mode]) | BACKENDS[backend]
    if mode == "preempt":
        options["num_kv_blocks"] = family.preempt_blocks
    llm = family.tests.make(ck, device=DEVICE, **options)
    assert llm.engine.runner.device.type == DEVICE.split(":")[0]
    # Under preemption a small pool may have evicted the first round's blocks: no hit needed.
    prompts, greedy = family.tests.PROMPTS, family.tests.GREEDY
    two_rounds(llm, ck, prompts, greedy, mode, expect_hits=mode != "preempt")


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("arch", list(FAMILIES))
def test_bfloat16_end_to_end_with_prefix_hits(arch, backend, request):
    family, ck = FAMILIES[arch], checkpoint(arch, request)
    prompts, greedy = family.tests.PROMPTS, family.tests.GREEDY
    llm = family.tests.make(ck, device=DEVICE, dtype="bfloat16", **BACKENDS[backend])
    assert str(llm.engine.runner.dtype) == "torch.bfloat16"
    first = llm.generate(prompts, greedy, use_tqdm=False)
    again = llm.generate(prompts, greedy, use_tqdm=False)
    vocab = ck.hf_model.config.vocab_size
    for outputs in (first, again):
        for out in tokens(outputs):
            assert len(out) == greedy.max_tokens and all(0 <= t < vocab for t in out)
    assert any(o.num_cached_tokens > 0 for o in again)
    assert llm.stats()["prefix_hit_tokens"] > 0
    assert llm.engine.manager.pool.num_used == 0
    # bfloat16 rounds the float32 model, it does not replace it: most first tokens agree.
    expected = [ck.reference(p, greedy.max_tokens) for p in prompts]
    agree = sum(out[0] == ref[0] for out, ref in zip(tokens(first), expected, strict=True))
    assert agree >= len(prompts) // 2, f"{agree} of {len(prompts)} first tokens agree"
