"""Verifying draft tokens: how many the target model accepts, and the token that follows.

A chunk with k drafts has k + 1 logits rows: row j is the target's
distribution for the token after draft j - 1 (row 0: after the sequence's
last token). Greedy: drafts are accepted while each equals its row's argmax,
and the token after them is the first row's argmax that differed (or the
last row's), so the output is the argmax chain itself, token for token what
decoding one token at a time gives.

With temperature > 0 this is rejection sampling (Leviathan et al., 2023;
Chen et al., 2023) with a drafter that proposes one token with certainty
(prompt lookup): draft d is accepted with probability p(d) (min(1, p/q) with
q(d) = 1); when it is rejected the token comes from the residual
max(0, p - q), that is p without d, renormalized; when every draft is
accepted the last row gives a bonus token from p. Each emitted token is
then distributed exactly as p, the filtered target distribution (temperature,
top-k, top-p, min-p: sampler.filtered_probs), whatever the drafts were.

Written here because the drafts, the rows and each request's own generator
are this engine's; the arithmetic is a few tensor operations.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvserve.batch import SeqChunk
from kvserve.model.sampling.draw import draw
from kvserve.model.sampling.sampler import filtered_probs
from kvserve.sampling_params import SamplingParams


def verify_greedy(logits: torch.Tensor, drafts: Sequence[int]) -> tuple[int, int]:
    """(drafts accepted, the token after them) from float32 `logits` [k + 1, vocab]."""
    targets = logits.argmax(dim=-1).tolist()
    accepted = 0
    for draft, target in zip(drafts, targets, strict=False):
        if draft != target:
            break
        accepted += 1
    return accepted, targets[accepted]


def verify_sampled(
    logits: torch.Tensor,
    drafts: Sequence[int],
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """(drafts accepted, the token after them) by rejection sampling (module docstring)."""
    probs = filtered_probs(logits, [params] * logits.shape[0])
    k = len(drafts)
    draft_ids = torch.tensor(list(drafts), device=probs.device)
    p_draft = probs[torch.arange(k, device=probs.device), draft_ids]
    uniform = torch.rand(k, generator=generator, device=probs.device, dtype=probs.dtype)
    rejected = (uniform >= p_draft).tolist()
    accepted = rejected.index(True) if True in rejected else k
    row = probs[accepted]
    if accepted < k:  # the residual: p without the rejected draft
        row = row.clone()
        row[drafts[accepted]] = 0.0
    return accepted, int(draw(row[None], [generator])[0])  # unnormalised: draw scales by the sum


def verify(
    logits: torch.Tensor,
    drafts: Sequence[int],
    params: SamplingParams | None,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """One chunk's verification: greedy for greedy params, rejection sampling otherwise."""
    if params is None or params.temperature == 0:
        return verify_greedy(logits, drafts)
    return verify_sampled(logits, drafts, params, generator)


def verify_chunk(
    logits: torch.Tensor, chunk: SeqChunk, generator: torch.Generator | None
) -> tuple[int, int | None, str | None]:
    """A chunk with drafts: (drafts accepted, the token after them, why it failed); its
    request fails alone. Penalties, bias, grammars and logprobs never reach here
    (kvserve.engine.drafter)."""
    try:
        accepted, token = verify(logits, chunk.draft_token_ids, chunk.params, generator)
    except Exception as exc:
        logging.getLogger(__name__).exception(
            "request %s: verifying its drafts failed", chunk.request_id
        )
        return 0, None, f"{type(exc).__name__}: {exc}"[:500]
    return accepted, token, None
