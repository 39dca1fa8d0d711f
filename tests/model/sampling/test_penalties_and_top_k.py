"""Penalties and logit bias on hand-made logits, and the runner's top-k logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.model.sampling.logprobs import token_logprobs
from kvserve.model.sampling.penalties import apply_penalties
from kvserve.sampling_params import SamplingParams
from tests.model.model_driver import make_chunk

ROW = [2.0, -1.0, 0.5, 3.0]
PROMPT = [0, 1]
GENERATED = [2, 2]


def adjusted(*params: SamplingParams | None) -> list[list[float]]:
    """Each params' row after apply_penalties, all in one batch (prompt 0 1, generated 2 2)."""
    logits = torch.tensor([ROW] * len(params))
    chunks = [
        make_chunk(f"r{i}", PROMPT + GENERATED, 3, [[1]], params=p, num_generated=2)
        for i, p in enumerate(params)
    ]
    apply_penalties(logits, chunks)
    return logits.tolist()


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        # Seen tokens 0, 1, 2 (prompt and output): positive / 2, negative * 2.
        ({"repetition_penalty": 2.0}, [1.0, -2.0, 0.25, 3.0]),
        # Token 2 generated twice: 0.5 - 0.5 (presence) - 2 * 0.25 (frequency).
        ({"presence_penalty": 0.5, "frequency_penalty": 0.25}, [2.0, -1.0, -0.5, 3.0]),
        ({"presence_penalty": -1.0}, [2.0, -1.0, 1.5, 3.0]),  # prompt tokens are not counted
        ({"logit_bias": {3: -5.0, "1": 1.0}}, [2.0, 0.0, 0.5, -2.0]),
        # Bias first, then repetition: (2 - 1) / 2, not 2 / 2 - 1.
        ({"logit_bias": {0: -1.0}, "repetition_penalty": 2.0}, [0.5, -2.0, 0.25, 3.0]),
    ],
)
def test_each_adjustment(kwargs, expected):
    assert adjusted(SamplingParams(**kwargs))[0] == expected


def test_rows_that_ask_nothing_are_untouched_in_a_mixed_batch():
    rows = adjusted(
        None,
        SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0),
        SamplingParams(temperature=0.5),
        SamplingParams(logit_bias={2: 3.0}),
    )
    assert rows[0] == rows[2] == ROW
    assert rows[1] == [1.0, -2.0, 0.25 - 2.0, 3.0]
    assert rows[3] == [2.0, -1.0, 3.5, 3.0]


def test_a_batch_without_adjustments_is_not_copied():
    logits = torch.tensor([ROW])
    chunk = make_chunk("p", PROMPT, 0, [[1]], params=SamplingParams())
    before = logits.data_ptr()
    apply_penalties(logits, [chunk])
    assert logits.tolist() == [ROW] and logits.data_ptr() == before
    assert not SamplingParams(logit_bias={}).adjusts_logits


def test_token_logprobs_ranks_and_top_k():
    logprobs = torch.log_softmax(torch.tensor([[1.0, 4.0, 2.0, 3.0], [0.0, 0.0, 5.0, 1.0]]), -1)
    found = token_logprobs(logprobs, [0, 2], [2, 0])
    assert (found[0].rank, found[0].top_ids) == (4, [1, 3])
    assert math.isclose(found[0].logprob, logprobs[0, 0].item())
    assert found[0].top_logprobs == logprobs[0, [1, 3]].tolist()
    assert (found[1].rank, found[1].top_ids, found[1].top_logprobs) == (1, [], [])
    # k above the vocabulary lists the whole vocabulary.
    (whole,) = token_logprobs(logprobs[:1], [1], [20])
    assert whole.top_ids == [1, 3, 2, 0] and whole.rank == 1
