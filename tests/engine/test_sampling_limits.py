"""SamplingParams' ranges: every integer a signed 64-bit one (a seed as vLLM takes it),
temperatures below 1e-5 greedy, flags strictly booleans; messages never echo huge values."""

from __future__ import annotations

import pytest
import torch

from kvserve.model.sampling.sampler import filtered_probs, sample
from kvserve.sampling_params import INT64_MAX, INT64_MIN, SamplingParams


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"seed": 2**64}, "seed"),
        ({"seed": INT64_MAX + 1}, "seed"),
        ({"seed": INT64_MIN - 1}, "seed"),
        ({"top_k": 2**63}, "top_k"),
        ({"max_tokens": 10**5000}, "max_tokens"),
        ({"n": 2**64}, "n"),
        ({"min_tokens": 2**70, "max_tokens": 2}, "min_tokens"),
        ({"stop_token_ids": [2**64]}, "stop_token_ids"),
        ({"logit_bias": {"9" * 30: 1}}, "logit_bias"),
        ({"logit_bias": {"5": 1e300}}, "logit_bias"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_out_of_range_values_name_their_field(kwargs, field):
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**kwargs)
    assert len(str(info.value)) < 200


def test_the_int64_edges_are_accepted():
    SamplingParams(seed=INT64_MIN)
    SamplingParams(seed=INT64_MAX, top_k=INT64_MAX, max_tokens=INT64_MAX)


@pytest.mark.parametrize("temperature", [1e-38, 5e-324, 9.9e-6])
def test_a_tiny_temperature_is_greedy(temperature):
    p = SamplingParams(temperature=temperature)
    assert p.greedy and p.temperature == 0.0
    assert not SamplingParams(temperature=1e-5).greedy


def test_a_top_k_past_the_vocabulary_keeps_it_all():
    logits = torch.randn(2, 50)
    huge = filtered_probs(logits.clone(), [SamplingParams(top_k=INT64_MAX, top_p=0.5)] * 2)
    plain = filtered_probs(logits.clone(), [SamplingParams(top_p=0.5)] * 2)
    torch.testing.assert_close(huge, plain)
    gen = torch.Generator().manual_seed(0)
    params = [SamplingParams(top_k=INT64_MAX, top_p=0.9, seed=INT64_MIN)] * 2
    assert len(sample(logits.clone(), list(params), [gen, gen])) == 2
