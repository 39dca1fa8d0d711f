"""Log-probabilities of sampled tokens and the most likely ones, for the rows that ask.

They come from the raw distribution, log_softmax of the float32 logits
before any penalty, bias, temperature or filter (vLLM's default): what the
model predicts, whatever the sampler then did with it. One top-k over the
rows that asked, with the largest k among them, and one transfer to Python.
"""

from __future__ import annotations

import torch

from kvserve.batch import TokenLogprobs


def token_logprobs(logprobs: torch.Tensor, tokens: list[int], ks: list[int]) -> list[TokenLogprobs]:
    """Per row of `logprobs` [R, vocab]: the sampled token's logprob and rank, and the
    top `ks[row]` tokens (most likely first)."""
    device = logprobs.device
    chosen = logprobs.gather(1, torch.tensor(tokens, device=device)[:, None])
    # Rank 1 is the most likely: one plus how many tokens are strictly more likely.
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    k = min(max(ks), logprobs.shape[-1])
    if k:
        top_values, top_ids = logprobs.topk(k, dim=-1)
        values, ids = top_values.tolist(), top_ids.tolist()
    else:
        values = ids = [[] for _ in tokens]
    return [
        TokenLogprobs(lp, rank, row_ids[:n], row_values[:n])
        for lp, rank, row_ids, row_values, n in zip(
            chosen[:, 0].tolist(), ranks, ids, values, ks, strict=True
        )
    ]
