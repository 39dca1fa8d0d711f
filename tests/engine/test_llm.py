"""LLM.generate on real tiny checkpoints: token-exact with transformers, whatever the cache does."""

import signal

import pytest
import torch

from kvserve import LLM, SamplingParams


def prompt(length, salt=0):
    gen = torch.Generator().manual_seed(7000 + 100 * salt + length)
    return torch.randint(3, 300, (length,), generator=gen).tolist()


NEW = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
SHARED = prompt(21, salt=1)
# Block size 4 in these tests: shorter than a block, exact multiples, several blocks,
# shared prefixes and identical prompts, all in one batch of 8.
PROMPTS = [
    prompt(3),
    prompt(8),
    [*SHARED, *prompt(6, salt=2)],
    [*SHARED, *prompt(3, salt=3)],
    list(SHARED),
    list(SHARED),
    prompt(16),
    prompt(1),
]


def make(ck, **kwargs):
    options = dict(block_size=4, num_kv_blocks=128, dtype="float32", device="cpu", num_threads=1)
    options.update(kwargs)
    return LLM(ck.path, **options)


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"enable_prefix_caching": False},
        {"max_num_batched_tokens": 7},  # chunked prefill, mixed prefill + decode steps
        {"num_kv_blocks": 24, "max_num_seqs": 8},  # preemption and recompute
        {"max_num_seqs": 1},
    ],
    ids=["cached", "no-cache", "chunked", "preempt", "serial"],
)
def test_greedy_equals_transformers(checkpoint, options):
    llm = make(checkpoint, **options)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    expected = [checkpoint.reference(p, NEW) for p in PROMPTS]
    assert tokens(outputs) == expected
    stats = llm.stats()
    if options.get("num_kv_blocks") == 24:
        assert stats["preemptions"] > 0
    if options.get("enable_prefix_caching") is False:
        # Without sharing, the identical prompts hold the same content twice.
        assert stats["prefix_hit_tokens"] == 0
        assert stats["duplicate_blocks_peak"] > 0
    else:
        assert stats["prefix_hit_tokens"] > 0
        assert stats["duplicate_blocks_peak"] == 0


def test_outputs_fields_order_and_cached_tokens(checkpoints):
    llm = make(checkpoints["qwen3"])
    first = llm.generate([list(SHARED)], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    outs = llm.generate([prompt(9), list(SHARED), [*SHARED, 5, 6]], GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [prompt(9), SHARED, [*SHARED, 5, 6]]
    # 21 tokens = 5 full blocks of 4 (all cached) + 1 token to compute.
    assert outs[1].num_cached_tokens == 20
    assert outs[2].num_cached_tokens == 20
    assert outs[1].outputs[0].token_ids == first.outputs[0].token_ids
    assert outs[0].outputs[0].finish_reason == "length"
    stats = llm.stats()
    for key in (
        "prompt_tokens",
        "prefill_tokens_computed",
        "prefix_hit_tokens",
        "peak_blocks_used",
        "duplicate_blocks_peak",
        "preemptions",
    ):
        assert key in stats


def test_fully_cached_prompt_same_tokens(checkpoints):
    ck = checkpoints["llama"]
    llm = make(ck)
    exact = prompt(16, salt=5)  # 4 full blocks: the second run hits all of them
    a = llm.generate([exact], GREEDY, use_tqdm=False)[0]
    b = llm.generate([exact], GREEDY, use_tqdm=False)[0]
    assert b.num_cached_tokens == 15
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == ck.reference(exact, NEW)


def test_identical_prompts_in_one_batch_are_computed_once(checkpoints):
    ck = checkpoints["qwen2"]
    llm = make(ck)
    same = prompt(18, salt=6)  # 4 full blocks + 2 tokens
    outs = llm.generate([same, same, same], GREEDY, use_tqdm=False)
    assert tokens(outs) == [ck.reference(same, NEW)] * 3
    stats = llm.stats()
    # The first computes all 18; the others share its pending blocks and compute the tail.
    assert stats["prefill_tokens_computed"] == 18 + 2 * 2
    assert [o.num_cached_tokens for o in outs] == [0, 16, 16]
    assert stats["duplicate_blocks_peak"] == 0


def test_n_completions_share_the_prompt(checkpoints):
    ck = checkpoints["qwen2"]
    llm = make(ck)
    params = SamplingParams(n=3, temperature=0, max_tokens=6, ignore_eos=True)
    out = llm.generate([prompt(13, salt=4)], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    expected = ck.reference(prompt(13, salt=4), 6)
    assert all(c.token_ids == expected for c in out.outputs)
    stats = llm.stats()
    # 13 tokens = 3 full blocks, computed once; each sequence computes its own tail token.
    assert stats["prefill_tokens_computed"] == 13 + 2 * 1
    assert stats["duplicate_blocks_peak"] == 0


def test_seeded_sampling_is_reproducible_and_batch_independent(checkpoints):
    ck = checkpoints["qwen3"]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=8, ignore_eos=True)
    alone = make(ck).generate([prompt(7)], params, use_tqdm=False)[0]
    crowd = make(ck).generate(
        [prompt(20, salt=8), prompt(7), prompt(3, salt=9)],
        [GREEDY, params, SamplingParams(temperature=1.0, max_tokens=8)],
        use_tqdm=False,
    )
    assert crowd[1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_bad_input_is_a_clear_error_and_the_engine_goes_on(checkpoints):
    ck = checkpoints["qwen3"]
    llm = make(ck, max_model_len=64)
    with pytest.raises(ValueError, match=r"prompt 1: .*empty"):
        llm.generate([prompt(5), []], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt 1: .*outside the vocabulary"):
        llm.generate([prompt(5), [1, 2, 99999]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt 0: .*max_model_len"):
        llm.generate([prompt(60)], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate([prompt(5)], [GREEDY, GREEDY], use_tqdm=False)
    with pytest.raises(TypeError):
        llm.generate([prompt(5), 3.5], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.manager.pool.num_used == 0
    out = llm.generate([prompt(5)], GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == ck.reference(prompt(5), NEW)


def test_unknown_keyword_and_missing_checkpoint_are_clear_errors(checkpoints, tmp_path):
    with pytest.raises(TypeError, match="block_sizee"):
        LLM(checkpoints["qwen3"].path, block_sizee=4)
    with pytest.raises(ValueError, match="missing"):
        LLM(str(tmp_path / "missing"))
    llm = make(checkpoints["qwen3"])
    assert tokens(llm.generate([prompt(4)], GREEDY, use_tqdm=False)) == [
        checkpoints["qwen3"].reference(prompt(4), NEW)
    ]


def test_stop_token_ids_and_max_tokens(checkpoints):
    ck = checkpoints["llama"]
    llm = make(ck)
    expected = ck.reference(prompt(9), NEW)
    stop = expected[3]
    cut = expected.index(stop)
    params = SamplingParams(temperature=0, max_tokens=NEW, stop_token_ids=[stop], ignore_eos=True)
    out = llm.generate([prompt(9)], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == expected[: cut + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_step_api_and_abort(checkpoints):
    ck = checkpoints["qwen3"]
    llm = make(ck)
    engine = llm.engine
    engine.add_request("a", prompt(11), SamplingParams(temperature=0, max_tokens=60))
    engine.add_request("b", prompt(6), GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("b", prompt(6), GREEDY)
    engine.step()
    engine.abort_request("a")
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
    assert list(done) == ["b"]
    assert done["b"].outputs[0].token_ids == ck.reference(prompt(6), NEW)
    assert engine.manager.pool.num_used == 0


def test_errors_name_the_prompt_not_the_request(checkpoints):
    llm = make(checkpoints["qwen3"], max_model_len=64)
    llm.generate([prompt(5)], GREEDY, use_tqdm=False)  # request ids 0..: the next is not 0
    with pytest.raises(ValueError) as info:
        llm.generate([prompt(5), [1, 2, 99999]], GREEDY, use_tqdm=False)
    assert str(info.value) == "prompt 1: token ids [99999] outside the vocabulary [0, 320)"
    two = SamplingParams(n=2, temperature=0, max_tokens=NEW)
    with pytest.raises(ValueError) as info:
        llm.generate([prompt(60)], two, use_tqdm=False)
    assert str(info.value) == (
        f"prompt 0: prompt (60 tokens) + max_tokens ({NEW}) exceeds max_model_len (64)"
    )
    out = llm.generate([prompt(5)], GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == checkpoints["qwen3"].reference(prompt(5), NEW)


def test_on_finished_and_ctrl_c_between_steps(checkpoints):
    ck = checkpoints["llama"]
    batch = [prompt(5), prompt(5, salt=1), prompt(5, salt=2)]
    seen = []

    def on_finished(i, output):
        seen.append((i, output.outputs[0].token_ids))
        if len(seen) == 1:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C while the engine is mid-run

    # All three finish in the same step: the Ctrl-C waits until that step is handed over.
    llm = make(ck)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(batch, GREEDY, use_tqdm=False, on_finished=on_finished)
    assert seen == [(i, ck.reference(p, NEW)) for i, p in enumerate(batch)]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    # One at a time: prompt 0 finishes, Ctrl-C stops the run before the next step.
    llm = make(ck, max_num_seqs=1)
    seen.clear()
    with pytest.raises(KeyboardInterrupt):
        llm.generate(batch, GREEDY, use_tqdm=False, on_finished=on_finished)
    assert seen == [(0, ck.reference(batch[0], NEW))]
    # The rest was aborted between steps: every block back, the engine usable.
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.manager.pool.num_used == 0
    order = []
    outs = llm.generate(batch, GREEDY, use_tqdm=False, on_finished=lambda i, o: order.append(i))
    assert order == [0, 1, 2] and tokens(outs) == [ck.reference(p, NEW) for p in batch]
