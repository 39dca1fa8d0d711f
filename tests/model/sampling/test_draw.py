"""Drawing a token from probabilities: the inverse CDF in two levels
(kvserve.model.sampling.draw)."""

from __future__ import annotations

import pytest
import torch

from kvserve.model.sampling.draw import BLOCK, draw, pick


def _uniform(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)[:, None]


def test_pick_is_the_inverse_of_the_cumulative_distribution():
    probs = torch.tensor([[0.25, 0.0, 0.25, 0.5]] * 5)
    got = pick(probs, _uniform([0.0, 0.2499, 0.25, 0.5, 0.9999])).tolist()
    assert got == [0, 0, 2, 3, 3]  # token 1 has no mass: never the one that crosses


def test_pick_never_returns_a_token_without_mass_at_either_end():
    vocab = 3 * BLOCK + 17  # padded to whole blocks inside: the padding is never picked
    probs = torch.zeros(2, vocab)
    probs[:, 5] = 0.5
    probs[:, 2 * BLOCK + 3] = 0.5
    almost_one = 1.0 - 2.0**-53
    assert pick(probs, _uniform([0.0, almost_one])).tolist() == [5, 2 * BLOCK + 3]


def test_pick_crosses_block_boundaries_exactly():
    vocab = 4 * BLOCK
    probs = torch.full((1, vocab), 1.0 / vocab)
    for token in (0, BLOCK - 1, BLOCK, 3 * BLOCK + 7, vocab - 1):
        u = (token + 0.5) / vocab
        assert pick(probs, _uniform([u])).tolist() == [token]


def test_unnormalised_rows_are_drawn_in_proportion():
    probs = torch.tensor([[2.0, 6.0]])  # 1/4 and 3/4
    assert pick(probs, _uniform([0.24])).tolist() == [0]
    assert pick(probs, _uniform([0.26])).tolist() == [1]


@pytest.mark.parametrize("vocab", [3, 1000, 49152])
def test_draws_follow_the_distribution(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(vocab, generator=gen) * 3
    logits[torch.randperm(vocab, generator=gen)[: vocab // 3]] = float("-inf")
    probs = torch.softmax(logits, -1)
    top = probs.topk(min(3, int((probs > 0).sum()))).indices
    draws = 6000
    rows = probs.expand(draws, vocab).contiguous()
    got = draw(rows, [None] * draws)
    assert bool((probs[got] > 0).all())  # masked tokens never come out
    counts = torch.bincount(got, minlength=vocab).double() / draws
    for token in top.tolist():  # the likely tokens at their rates (5 sigma)
        p = probs[token].item()
        assert abs(counts[token].item() - p) < 5 * (p * (1 - p) / draws) ** 0.5 + 1e-3


def test_a_seeded_row_draws_the_same_token_whatever_shares_its_batch():
    probs = torch.softmax(torch.randn(4, 500, generator=torch.Generator().manual_seed(1)), -1)
    alone = draw(probs[2:3], [torch.Generator().manual_seed(7)])
    mixed = draw(probs, [None, None, torch.Generator().manual_seed(7), None])
    assert mixed[2].item() == alone[0].item()
