"""Draft verification: greedy is the argmax chain; sampling keeps the target distribution.

The statistical test draws many verifications of the same drafts over a
tiny vocabulary with a seeded generator and compares what is emitted at the
first and the second position with the filtered target distribution
(chi-square). The same test applied to naive verifiers (accept every draft;
accept with p(d) but resample from p instead of the residual) must fail:
otherwise it could not catch a wrong verifier.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvserve.model.sampling.sampler import filtered_probs
from kvserve.model.sampling.speculative import verify, verify_greedy, verify_sampled
from kvserve.sampling_params import SamplingParams

VOCAB = 6
TRIALS = 4000
PARAMS = SamplingParams(temperature=0.8, top_k=5)
LOGITS = torch.tensor(
    [
        [1.0, 0.2, 0.9, -0.5, 0.4, -2.0],
        [0.1, 1.2, -0.3, 0.8, 0.0, 0.5],
        [0.6, -0.1, 0.3, 1.1, -0.7, 0.2],
    ]
)
DRAFTS = [2, 3]

Verifier = Callable[[torch.Tensor, list[int], torch.Generator], tuple[int, int]]


def emitted(verifier: Verifier) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts of the first emitted token, and of the second where the first was DRAFTS[0]."""
    gen = torch.Generator().manual_seed(1234)
    first = torch.zeros(VOCAB)
    second = torch.zeros(VOCAB)
    for _ in range(TRIALS):
        accepted, token = verifier(LOGITS.clone(), DRAFTS, gen)
        tokens = [*DRAFTS[:accepted], token]
        first[tokens[0]] += 1
        if tokens[0] == DRAFTS[0] and len(tokens) > 1:
            second[tokens[1]] += 1
    return first, second


def p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of `counts` against `probs` (cells with p > 0)."""
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token outside the filtered distribution was emitted"
    expected = probs[keep] * counts.sum()
    statistic = ((counts[keep] - expected) ** 2 / expected).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), statistic / 2))


def passes(verifier: Verifier) -> bool:
    target = filtered_probs(LOGITS.clone(), [PARAMS] * 3)
    first, second = emitted(verifier)
    return p_value(first, target[0]) > 1e-3 and p_value(second, target[1]) > 1e-3


def ours(logits: torch.Tensor, drafts: list[int], gen: torch.Generator) -> tuple[int, int]:
    return verify_sampled(logits, drafts, PARAMS, gen)


def accept_all(logits: torch.Tensor, drafts: list[int], gen: torch.Generator) -> tuple[int, int]:
    probs = filtered_probs(logits, [PARAMS] * logits.shape[0])
    return len(drafts), int(torch.multinomial(probs[-1], 1, generator=gen))


def resample_from_p(
    logits: torch.Tensor, drafts: list[int], gen: torch.Generator
) -> tuple[int, int]:
    probs = filtered_probs(logits, [PARAMS] * logits.shape[0])
    for j, draft in enumerate(drafts):
        if torch.rand(1, generator=gen) >= probs[j, draft]:
            return j, int(torch.multinomial(probs[j], 1, generator=gen))  # not the residual
    return len(drafts), int(torch.multinomial(probs[-1], 1, generator=gen))


def test_rejection_sampling_keeps_the_target_distribution():
    assert passes(ours)


def test_the_statistical_test_catches_naive_verifiers():
    assert not passes(accept_all)
    assert not passes(resample_from_p)


def test_greedy_accepts_the_argmax_chain_and_corrects_the_first_miss():
    targets = LOGITS.argmax(dim=-1).tolist()  # [0, 1, 3]
    assert verify_greedy(LOGITS, targets[:2]) == (2, targets[2])
    assert verify_greedy(LOGITS, [targets[0], 4]) == (1, targets[1])
    assert verify_greedy(LOGITS, [5, targets[1]]) == (0, targets[0])
    assert verify(LOGITS, [5, 5], None, None) == (0, targets[0])
    greedy = SamplingParams(temperature=0)
    assert verify(LOGITS, targets[:2], greedy, None) == (2, targets[2])
