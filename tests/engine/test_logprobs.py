"""Logprobs through LLM.generate and the step API, against transformers on the same weights."""

from __future__ import annotations

import math

import pytest
import torch
from _runs import run

from kvserve import LLM, SamplingParams
from kvserve.engine.engine_args import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.model_free_runner import ModelFreeRunner
from kvserve.sampling_params import RequestOutputKind

CUMULATIVE, DELTA, FINAL = (
    RequestOutputKind.CUMULATIVE,
    RequestOutputKind.DELTA,
    RequestOutputKind.FINAL_ONLY,
)
ENGINE = dict(block_size=4, num_kv_blocks=128, dtype="float32", device="cpu", num_threads=1)
TOP = 5


def prompt(length: int, salt: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(9000 + 100 * salt + length)
    return torch.randint(3, 300, (length,), generator=gen).tolist()


def reference(ck, prompt_ids: list[int], output: list[int]) -> torch.Tensor:
    """transformers' log_softmax at each generated position: [len(output), vocab]."""
    ids = torch.tensor([prompt_ids + output[:-1]])
    with torch.no_grad():
        logits = ck.hf_model(ids).logits[0, len(prompt_ids) - 1 :].float()
    return torch.log_softmax(logits, dim=-1)


def sampled(completion) -> list:
    """The sampled token's Logprob at each position."""
    pairs = zip(completion.token_ids, completion.logprobs, strict=True)
    return [entry[token] for token, entry in pairs]


def check_against_reference(ck, prompt_ids, completion, top=TOP):
    """Every entry: the sampled token, the top `top` by rank, values as transformers gives."""
    output = completion.token_ids
    ref = reference(ck, prompt_ids, output)
    assert len(completion.logprobs) == len(output)
    for position, (token, entry) in enumerate(zip(output, completion.logprobs, strict=True)):
        row = ref[position]
        top_ids = row.topk(top).indices.tolist() if top else []
        assert next(iter(entry)) == token, "the sampled token comes first"
        assert set(entry) == {token, *top_ids}
        for rank, tid in enumerate(top_ids, 1):
            assert entry[tid].rank == rank
        sampled_rank = int((row > row[token]).sum()) + 1
        assert entry[token].rank == sampled_rank
        for tid, lp in entry.items():
            assert math.isclose(lp.logprob, row[tid].item(), abs_tol=2e-4), (position, tid)
    total = sum(lp.logprob for lp in sampled(completion))
    assert math.isclose(completion.cumulative_logprob, total, rel_tol=1e-9, abs_tol=1e-9)


def test_greedy_logprobs_equal_transformers(checkpoint):
    llm = LLM(checkpoint.path, **ENGINE)
    prompts = [prompt(3), prompt(9, salt=1), prompt(16, salt=2)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=TOP)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for p, out in zip(prompts, outputs, strict=True):
        completion = out.outputs[0]
        assert completion.token_ids == checkpoint.reference(p, 12)
        check_against_reference(checkpoint, p, completion)
        assert all(lp.rank == 1 for lp in sampled(completion))


def test_sampled_tokens_outside_the_top_are_listed_with_their_rank(checkpoints):
    ck = checkpoints["qwen3"]
    llm = LLM(ck.path, **ENGINE)
    p = prompt(7, salt=3)
    # Hot sampling picks unlikely tokens: entries with logprobs + 1 tokens appear.
    params = SamplingParams(temperature=3.0, seed=5, max_tokens=24, ignore_eos=True, logprobs=2)
    completion = llm.generate([p], params, use_tqdm=False)[0].outputs[0]
    check_against_reference(ck, p, completion, top=2)
    assert max(lp.rank for lp in sampled(completion)) > 2
    assert any(len(entry) == 3 for entry in completion.logprobs)


def test_logprobs_are_the_raw_distribution_whatever_changes_the_draw(checkpoints):
    ck = checkpoints["qwen3"]
    llm = LLM(ck.path, **ENGINE)
    p = prompt(8, salt=7)
    params = SamplingParams(
        temperature=0.5,
        seed=1,
        top_k=4,
        max_tokens=10,
        ignore_eos=True,
        logprobs=3,
        repetition_penalty=1.5,
        logit_bias={42: 6.0},
    )
    completion = llm.generate([p], params, use_tqdm=False)[0].outputs[0]
    assert 42 in completion.token_ids  # the bias shows in the draw, not in the logprobs
    check_against_reference(ck, p, completion, top=3)


def test_logprobs_zero_gives_only_the_sampled_token_and_none_when_not_asked(checkpoints):
    ck = checkpoints["llama"]
    llm = LLM(ck.path, **ENGINE)
    p = prompt(6, salt=4)
    base = dict(temperature=0, max_tokens=6, ignore_eos=True)
    only, plain = llm.generate(
        [p, p], [SamplingParams(logprobs=0, **base), SamplingParams(**base)], use_tqdm=False
    )
    check_against_reference(ck, p, only.outputs[0], top=0)
    assert all(len(entry) == 1 for entry in only.outputs[0].logprobs)
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None
    assert plain.outputs[0].token_ids == only.outputs[0].token_ids


def test_each_of_n_completions_has_its_own_logprobs(checkpoints):
    ck = checkpoints["qwen2"]
    llm = LLM(ck.path, **ENGINE)
    p = prompt(11, salt=5)
    params = SamplingParams(n=3, temperature=1.5, seed=3, max_tokens=10, logprobs=3)
    out = llm.generate([p], params, use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for completion in out.outputs:
        check_against_reference(ck, p, completion, top=3)
    again = llm.generate([p], params, use_tqdm=False)[0]  # seeds as before: the same draws
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_a_prefix_cached_prompt_gives_the_same_logprobs(checkpoints):
    ck = checkpoints["qwen3"]
    llm = LLM(ck.path, **ENGINE)
    p = prompt(17, salt=6)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=TOP)
    first = llm.generate([p], params, use_tqdm=False)[0]
    second = llm.generate([p], params, use_tqdm=False)[0]
    assert second.num_cached_tokens == 16
    # Same tokens, ranks and texts; the values agree to float rounding (the last prompt
    # token is computed alone instead of in a 17-row product).
    a, b = first.outputs[0], second.outputs[0]
    assert b.token_ids == a.token_ids
    assert [{t: e.rank for t, e in d.items()} for d in b.logprobs] == [
        {t: e.rank for t, e in d.items()} for d in a.logprobs
    ]
    for da, db in zip(a.logprobs, b.logprobs, strict=True):
        for t in da:
            assert math.isclose(db[t].logprob, da[t].logprob, abs_tol=1e-5)
    assert math.isclose(b.cumulative_logprob, a.cumulative_logprob, abs_tol=1e-4)
    check_against_reference(ck, p, first.outputs[0])


def test_delta_logprobs_concatenate_to_the_cumulative_ones(demo_model):
    # One engine per kind: the same computation, so the values must agree exactly.
    outs = {}
    for kind in (CUMULATIVE, DELTA, FINAL):
        engine = LLMEngine(demo_model, EngineArgs(**ENGINE))
        params = SamplingParams(temperature=0, max_tokens=9, logprobs=3, output_kind=kind, n=2)
        engine.add_request(kind.name, [5, 6, 7, 8, 9], params)
        outs.update(run(engine))
    final = outs["FINAL_ONLY"]
    assert len(final) == 1
    for index in (0, 1):
        whole = final[0].outputs[index]
        assert len(whole.logprobs) == len(whole.token_ids) == 9
        cumulative = [o.outputs[index] for o in outs["CUMULATIVE"]]
        deltas = [o.outputs[index] for o in outs["DELTA"]]
        assert cumulative[-1].logprobs == whole.logprobs
        assert [entry for c in deltas for entry in c.logprobs] == whole.logprobs
        assert [len(c.logprobs) for c in deltas] == [len(c.token_ids) for c in deltas]
        # Every kind reports the running total, not a per-delta sum.
        assert [c.cumulative_logprob for c in deltas] == [c.cumulative_logprob for c in cumulative]
        assert math.isclose(
            whole.cumulative_logprob,
            sum(lp.logprob for lp in sampled(whole)),
        )
        # The demo has a tokenizer: each entry carries its token's own text.
        tokenizer = engine.tokenizer
        for entry in whole.logprobs:
            for tid, lp in entry.items():
                assert lp.decoded_token == tokenizer.decode([tid])


def test_the_model_free_runner_reports_a_point_mass():
    engine = LLMEngine.from_runner(
        ModelFreeRunner(num_blocks=32, hash_block_size=4), EngineArgs(block_size=4)
    )
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4, logprobs=3))
    engine.add_request("b", [1, 2, 3], SamplingParams(max_tokens=4, logprobs=0))
    outs = run(engine)
    for rid in ("a", "b"):
        completion = outs[rid][-1].outputs[0]
        assert len(completion.logprobs) == 4 and completion.cumulative_logprob == 0.0
        for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
            assert list(entry) == [token]
            assert (entry[token].logprob, entry[token].rank, entry[token].decoded_token) == (
                0.0,
                1,
                None,
            )


@pytest.mark.parametrize("logprobs", [-1, 21, 2.0, True])
def test_bad_logprobs_are_refused(logprobs):
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=logprobs)
