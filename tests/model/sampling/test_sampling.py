"""Sampling: parameters validated, filters correct, seeded draws independent of the batch."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.model.sampling.sampler import filtered_probs, sample
from kvserve.sampling_params import SamplingParams
from tests.model.model_driver import NEW, Driver, Request, make_chunk, prompt

# -- SamplingParams -------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"seed": "x"}, "seed"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"min_p": float("-inf")}, "min_p"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": 1.0}, "logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"frequency_penalty": float("inf")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"repetition_penalty": "1.2"}, "repetition_penalty"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"logit_bias": {"a": 1.0}}, "logit_bias"),
        ({"logit_bias": {"-1": 1.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {True: 1.0}}, "logit_bias"),
        ({"logit_bias": {5: 100.5}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"logit_bias": {5: "1"}}, "logit_bias"),
    ],
)
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_valid_params_and_defaults():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (1, 1.0, 1.0, -1, 0, 16)
    assert SamplingParams(stop="END").stop == ["END"]
    assert SamplingParams(temperature=0).greedy
    SamplingParams(top_k=0, min_tokens=16, max_tokens=16, seed=0, stop_token_ids=[1, 2])
    assert (p.logprobs, p.presence_penalty, p.frequency_penalty) == (None, 0.0, 0.0)
    assert (p.repetition_penalty, p.logit_bias, p.adjusts_logits) == (1.0, None, False)
    edges = SamplingParams(
        logprobs=20, presence_penalty=-2, frequency_penalty=2, repetition_penalty=0.01
    )
    assert edges.adjusts_logits
    biased = SamplingParams(logit_bias={"12": 100, 3: -100.0, 0: 0.5})
    assert biased.logit_bias == {12: 100.0, 3: -100.0, 0: 0.5}
    assert all(type(k) is int for k in biased.logit_bias)


def test_sampling_params_module_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, kvserve.sampling_params; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# -- sampler ------------------------------------------------------------------------


def test_filters_keep_the_right_tokens():
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3]]))
    kept = lambda **kw: (filtered_probs(logits, [SamplingParams(**kw)])[0] > 0).tolist()  # noqa: E731
    assert kept(top_k=2) == [False, True, False, True]
    assert kept(top_p=0.6) == [False, True, False, True]  # 0.4 + 0.3 covers 0.6
    assert kept(top_p=0.4) == [False, True, False, False]
    assert kept(top_p=0.01) == [False, True, False, False]  # the top token always survives
    assert kept(min_p=0.6) == [False, True, False, True]  # >= 0.6 * 0.4
    assert kept(top_k=3, top_p=0.75) == [False, True, False, True]  # renormalised after top-k
    probs = filtered_probs(logits, [SamplingParams(top_k=2)])[0]
    assert math.isclose(probs[1].item(), 0.4 / 0.7, rel_tol=1e-5)


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    cold = filtered_probs(logits, [SamplingParams(temperature=0.1)])[0]
    hot = filtered_probs(logits, [SamplingParams(temperature=10.0)])[0]
    assert cold[2] > 0.99
    assert hot.max() - hot.min() < 0.1


def test_draws_follow_the_distribution():
    logits = torch.log(torch.tensor([[0.2, 0.5, 0.3]]))
    gen = torch.Generator().manual_seed(0)
    params = [SamplingParams(seed=0)]
    counts = [0, 0, 0]
    for _ in range(3000):
        counts[sample(logits, params, [gen])[0]] += 1
    for count, p in zip(counts, (0.2, 0.5, 0.3), strict=True):
        assert abs(count / 3000 - p) < 0.04


def test_greedy_rows_ignore_generators_and_filters():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0]])
    params = [None, SamplingParams(temperature=0, top_k=1, top_p=0.1)]
    assert sample(logits, params, [None, None]) == [1, 0]


# -- seeded sampling through the runner ------------------------------------------------

SEEDED = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=42, max_tokens=NEW)


def _run(runner, requests, **kwargs):
    return Driver(runner, **kwargs).run(requests)


def test_seeded_request_is_reproducible_whatever_the_batch(runners):
    runner = runners["qwen3"]
    p = prompt(13, salt=20)
    alone = _run(runner, [Request("s", p, NEW, SEEDED)])[0]
    others = [
        Request("o1", prompt(7, salt=21), NEW, SamplingParams(temperature=1.0)),
        Request("o2", prompt(20, salt=22), NEW, SamplingParams(temperature=0.7, seed=1)),
        Request("o3", prompt(3, salt=23), NEW),
    ]
    crowded = _run(runner, [*others, Request("s", p, NEW, SEEDED, arrival_step=1)], chunk_size=5)
    assert crowded[-1] == alone
    assert len(set(alone)) > 1


def test_different_seeds_differ_and_unseeded_rows_still_sample(runners):
    runner = runners["qwen3"]
    p = prompt(9, salt=24)
    hot = dict(temperature=1.5, max_tokens=NEW)
    outputs = _run(
        runner,
        [Request(f"d{seed}", p, NEW, SamplingParams(seed=seed, **hot)) for seed in range(4)],
    )
    assert len({tuple(o) for o in outputs}) > 1


def test_temperature_zero_is_greedy(checkpoints, runners):
    runner, ck = runners["llama"], checkpoints["llama"]
    p = prompt(10, salt=25)
    greedy = SamplingParams(temperature=0.0, top_k=3, top_p=0.5, seed=7, max_tokens=NEW)
    assert _run(runner, [Request("g", p, NEW, greedy)]) == [ck.reference(p, NEW)]


def test_free_request_drops_the_generator(runners):
    runner = runners["qwen2"]
    p = prompt(6, salt=26)
    first = _run(runner, [Request("same-id", p, NEW, SEEDED)])
    assert "same-id" not in runner._generators
    assert _run(runner, [Request("same-id", p, NEW, SEEDED)]) == first


def test_banned_tokens_are_never_picked():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 4.0]])
    gen = torch.Generator().manual_seed(0)
    params = [None, SamplingParams(temperature=0.5, seed=1)]
    for _ in range(20):
        assert sample(logits.clone(), params, [None, gen], [{1}, {1, 2}]) == [2, 0]


def test_min_tokens_holds_back_eos_and_stop_tokens(checkpoints, runners):
    runner, ck = runners["qwen3"], checkpoints["qwen3"]
    p = prompt(6, salt=27)
    first = ck.reference(p, 1)[0]
    params = SamplingParams(temperature=0, min_tokens=2, max_tokens=4)
    chunk = lambda **kw: make_chunk("mt", p, 0, [[1, 2]], params=params, **kw)  # noqa: E731
    saved = runner.eos_token_ids
    try:
        runner.eos_token_ids = {first}
        assert runner.execute([chunk()]).tokens != [first]
        assert runner.execute([chunk(num_generated=2)]).tokens == [first]
        params.ignore_eos = True
        assert runner.execute([chunk()]).tokens == [first]
        params.stop_token_ids = [first]
        assert runner.execute([chunk(num_generated=1)]).tokens != [first]
    finally:
        runner.eos_token_ids = saved


def test_a_mixed_batch_reads_no_scalar_from_the_device_row_by_row():
    """Greedy and random rows come back in one copy at the end (no `.item()` per row: on a
    GPU each would wait for the device)."""
    from torch.profiler import ProfilerActivity, profile

    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(3))
    params = [None, *(SamplingParams(temperature=0.7, seed=s) for s in range(4)), None]
    generators = [None, *(torch.Generator().manual_seed(s) for s in range(4)), None]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        tokens = sample(logits, params, generators)
    assert len(tokens) == 6 and all(isinstance(t, int) for t in tokens)
    scalar_reads = [e.key for e in prof.key_averages() if e.key in ("aten::item",
                    "aten::_local_scalar_dense")]  # fmt: skip
    assert scalar_reads == []
