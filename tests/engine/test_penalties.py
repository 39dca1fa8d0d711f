"""Penalties and logit bias through LLM.generate: greedy tokens equal transformers' with the
same adjustments (its own RepetitionPenaltyLogitsProcessor, or a small reference loop)."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams

ENGINE = dict(block_size=4, num_kv_blocks=128, dtype="float32", device="cpu", num_threads=1)
NEW = 16
PLAIN = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def prompt(length: int, salt: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(11000 + 100 * salt + length)
    return torch.randint(3, 300, (length,), generator=gen).tolist()


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, **kwargs)


def reference_loop(ck, prompt_ids, new, bias=None, repetition=1.0, presence=0.0, frequency=0.0):
    """Greedy decoding over transformers' logits, adjusted as OpenAI / vLLM define it."""
    ids = list(prompt_ids)
    out: list[int] = []
    for _ in range(new):
        with torch.no_grad():
            logits = ck.hf_model(torch.tensor([ids])).logits[0, -1].float()
        for token, value in (bias or {}).items():
            logits[token] += value
        for token in set(ids):
            value = logits[token]
            logits[token] = value / repetition if value > 0 else value * repetition
        for token in set(out):
            logits[token] -= presence + frequency * out.count(token)
        token = int(logits.argmax())
        out.append(token)
        ids.append(token)
    return out


def test_repetition_penalty_equals_transformers_generate(checkpoint):
    llm = LLM(checkpoint.path, **ENGINE)
    prompts = [prompt(5), prompt(12, salt=1)]
    for penalty in (1.3, 0.8):
        outputs = llm.generate(prompts, greedy(repetition_penalty=penalty), use_tqdm=False)
        changed = False
        for p, out in zip(prompts, outputs, strict=True):
            with torch.no_grad():
                expected = checkpoint.hf_model.generate(
                    torch.tensor([p]),
                    do_sample=False,
                    max_new_tokens=NEW,
                    repetition_penalty=penalty,
                    pad_token_id=0,
                )[0, len(p) :].tolist()
            assert out.outputs[0].token_ids == expected
            changed |= expected != checkpoint.reference(p, NEW)
        assert changed, "the penalty changed nothing: the test would not see it ignored"


@pytest.mark.parametrize(
    "adjust",
    [
        {"presence": 1.5},
        {"frequency": 0.7},
        {"presence": -0.5, "frequency": 1.0, "repetition": 1.2},
        {"bias": {7: 4.0, 50: -3.0, 120: 2.5}},
        {"bias": {31: 3.0}, "presence": 2.0, "repetition": 1.5},
    ],
    ids=["presence", "frequency", "all-penalties", "bias", "bias-and-penalties"],
)
def test_penalties_and_bias_equal_a_reference_loop(checkpoints, adjust):
    ck = checkpoints["qwen3"]
    llm = LLM(ck.path, **ENGINE)
    names = {
        "presence": "presence_penalty",
        "frequency": "frequency_penalty",
        "repetition": "repetition_penalty",
        "bias": "logit_bias",
    }
    params = greedy(**{names[k]: v for k, v in adjust.items()})
    prompts = [prompt(4, salt=2), prompt(10, salt=3)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    changed = False
    for p, out in zip(prompts, outputs, strict=True):
        expected = reference_loop(ck, p, NEW, **adjust)
        assert out.outputs[0].token_ids == expected
        changed |= expected != ck.reference(p, NEW)
    assert changed, "the adjustment changed nothing: the test would not see it ignored"


def test_a_large_bias_forces_a_token_and_minus_100_bans_one(checkpoints):
    ck = checkpoints["llama"]
    llm = LLM(ck.path, **ENGINE)
    p = prompt(9, salt=4)
    plain = ck.reference(p, NEW)
    banned = plain[0]
    hot = dict(temperature=1.0, seed=2, max_tokens=NEW, ignore_eos=True)
    forced, sampled_forced, ban, sampled_ban = llm.generate(
        [p] * 4,
        [
            greedy(logit_bias={42: 100}),
            SamplingParams(logit_bias={42: 100}, **hot),
            greedy(logit_bias={banned: -100}),
            SamplingParams(logit_bias={str(banned): -100}, **hot),
        ],
        use_tqdm=False,
    )
    assert forced.outputs[0].token_ids == [42] * NEW
    assert sampled_forced.outputs[0].token_ids == [42] * NEW
    assert banned not in ban.outputs[0].token_ids
    assert banned not in sampled_ban.outputs[0].token_ids
    assert ban.outputs[0].token_ids == reference_loop(ck, p, NEW, bias={banned: -100})


def test_plain_requests_in_a_penalised_batch_keep_their_tokens(checkpoints):
    ck = checkpoints["qwen2"]
    llm = LLM(ck.path, **ENGINE)
    prompts = [prompt(6, salt=5), prompt(13, salt=6), prompt(6, salt=5), prompt(3, salt=7)]
    params = [
        PLAIN,
        greedy(frequency_penalty=1.2, logit_bias={9: 2.0}),
        greedy(repetition_penalty=1.4, presence_penalty=0.6),
        PLAIN,
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert tokens[0] == ck.reference(prompts[0], NEW)
    assert tokens[3] == ck.reference(prompts[3], NEW)
    assert tokens[1] == reference_loop(ck, prompts[1], NEW, bias={9: 2.0}, frequency=1.2)
    assert tokens[2] == reference_loop(ck, prompts[2], NEW, repetition=1.4, presence=0.6)
    assert tokens[2] != tokens[0]  # same prompt: only the penalties differ


def test_min_tokens_still_bans_stop_tokens_under_a_bias(checkpoints):
    ck = checkpoints["qwen3"]
    llm = LLM(ck.path, **ENGINE)
    p = prompt(7, salt=8)
    # The bias makes 11 the greedy pick; as a stop token it must wait for min_tokens.
    params = SamplingParams(
        temperature=0, max_tokens=6, min_tokens=3, stop_token_ids=[11], logit_bias={11: 100}
    )
    out = llm.generate([p], params, use_tqdm=False)[0].outputs[0]
    assert 11 not in out.token_ids[:3]
    assert out.token_ids[3] == 11 and out.finish_reason == "stop" and len(out.token_ids) == 4


def test_a_bias_outside_the_vocabulary_is_refused_and_the_engine_goes_on(checkpoints):
    ck = checkpoints["qwen3"]
    llm = LLM(ck.path, **ENGINE)
    p = prompt(5, salt=9)
    with pytest.raises(ValueError, match="logit_bias token id 320"):
        llm.generate([p, p], [PLAIN, greedy(logit_bias={320: 1.0})], use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias token id 5000"):
        llm.engine.add_request("x", p, greedy(logit_bias={"5000": 1.0}))
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([p], greedy(logit_bias={319: 1.0}), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference_loop(ck, p, NEW, bias={319: 1.0})
