"""LoRA adapters give peft's tokens: greedy tokens of a batch mixing two adapters and the
base model equal `PeftModel.generate`'s (and transformers' for the base), with caching on
and off, under preemption and chunked prefill, with the CPU tier reloading blocks, and
with fewer adapter slots than adapters in the batch (kvserve.lora)."""

from __future__ import annotations

import pytest

from kvserve import LLM, LoRARequest, SamplingParams
from tests.lora.conftest import make_adapter, two_adapters

NEW = 8
PROMPTS = [[3, 17, 29, 41, 5, 8, 13], [7, 7, 9, 22, 31], [3, 17, 29, 41, 5, 8, 13], [50, 2, 4]]


def lora(name: str, adapter, int_id: int = 1) -> LoRARequest:
    return LoRARequest(name, int_id, adapter.path)


def expected(ck, adapters, prompts, names) -> list[list[int]]:
    return [
        ck.reference(p, NEW) if name is None else adapters[name].reference(p, NEW)
        for p, name in zip(prompts, names, strict=True)
    ]


def run(llm: LLM, adapters, prompts, names) -> list[list[int]]:
    requests = [None if n is None else lora(n, adapters[n], 1 + i) for i, n in enumerate(names)]
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=requests)
    return [o.outputs[0].token_ids for o in outs]


CASES = {
    "cached": dict(num_kv_blocks=128, max_loras=2),
    "uncached": dict(num_kv_blocks=128, max_loras=2, enable_prefix_caching=False),
    "preempt-chunked": dict(num_kv_blocks=10, max_num_batched_tokens=6, max_loras=2),
    "one-slot": dict(num_kv_blocks=128, max_loras=1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_mixed_batch_gives_each_rows_own_adapters_tokens(checkpoints, llama_adapters, case):
    ck = checkpoints["llama"]
    llm = LLM(ck.path, block_size=4, dtype="float32", num_threads=1, enable_lora=True,
              **CASES[case])  # fmt: skip
    names = ["all", "attn", None, "all"]
    want = expected(ck, llama_adapters, PROMPTS, names)
    assert want[0] != ck.reference(PROMPTS[0], NEW)  # the adapter changes the answer
    assert run(llm, llama_adapters, PROMPTS, names) == want
    # The same prompt under each: its own tokens again (now with blocks cached).
    three = [PROMPTS[0]] * 3
    assert run(llm, llama_adapters, three, ["attn", None, "all"]) == expected(
        ck, llama_adapters, three, ["attn", None, "all"]
    )
    if case == "preempt-chunked":
        assert llm.stats()["preemptions"] > 0


def test_the_cpu_tier_reloads_each_adapters_own_blocks(checkpoints, llama_adapters):
    """Blocks written to the CPU tier and loaded back keep their adapter: the same prompt
    under two adapters and the base, every hit from the tier (the device cache reset)."""
    ck = checkpoints["llama"]
    llm = LLM(ck.path, block_size=4, dtype="float32", num_threads=1, enable_lora=True,
              num_kv_blocks=24, max_loras=2, offload="cpu:64MiB")  # fmt: skip
    names = ["all", "attn", None, "all"]
    want = expected(ck, llama_adapters, PROMPTS, names)
    assert run(llm, llama_adapters, PROMPTS, names) == want
    same = [PROMPTS[0]] * 3
    for order in (["attn", None, "all"], [None, "all", "attn"]):
        llm.reset_prefix_cache()  # the device's blocks gone: the tier's remain
        loaded = llm.stats()["external_hit_tokens"]
        assert run(llm, llama_adapters, same, order) == expected(ck, llama_adapters, same, order)
        assert llm.stats()["external_hit_tokens"] > loaded


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_other_families_mixed_batches(arch, checkpoints, gemma3_checkpoint, tmp_path):
    """Qwen3 (q/k norms) and Gemma 3 (sliding windows beside full attention), preempting."""
    ck = gemma3_checkpoint if arch == "gemma3" else checkpoints[arch]
    adapters = two_adapters(ck, tmp_path)
    llm = LLM(ck.path, block_size=4, dtype="float32", num_threads=1, enable_lora=True,
              num_kv_blocks=48 if arch == "gemma3" else 24, max_num_batched_tokens=6,
              max_loras=2)  # fmt: skip
    names = ["all", "attn", None, "all"]
    assert run(llm, adapters, PROMPTS, names) == expected(ck, adapters, PROMPTS, names)


def test_phi3_fused_projections_take_their_adapters(dense_checkpoints, tmp_path):
    """Phi-3 stores q/k/v and gate/up fused; PEFT targets qkv_proj and gate_up_proj."""
    ck = dense_checkpoints["phi3"]
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    adapters = {"all": make_adapter(ck, tmp_path / "phi3", seed=3, targets=targets)}
    llm = LLM(ck.path, block_size=4, dtype="float32", num_threads=1, enable_lora=True,
              num_kv_blocks=64, max_loras=1)  # fmt: skip
    names = ["all", None, "all"]
    want = expected(ck, adapters, PROMPTS[:3], names)
    assert want[0] != ck.reference(PROMPTS[0], NEW)
    assert run(llm, adapters, PROMPTS[:3], names) == want


def test_a_mixture_of_experts_takes_attention_adapters(tmp_path_factory, tmp_path):
    """Qwen3-MoE: adapters on its attention alone (its experts: test_lora_moe.py)."""
    from tests.model.moe_checkpoints import moe_checkpoint

    ck = moe_checkpoint(tmp_path_factory, "qwen3_moe")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    adapters = {"attn": make_adapter(ck, tmp_path / "moe", seed=4, targets=targets)}
    llm = LLM(ck.path, block_size=4, dtype="float32", num_threads=1, enable_lora=True,
              num_kv_blocks=64, max_loras=1)  # fmt: skip
    names = ["attn", None]
    want = expected(ck, adapters, PROMPTS[:2], names)
    assert want[0] != ck.reference(PROMPTS[0], NEW)
    assert run(llm, adapters, PROMPTS[:2], names) == want
