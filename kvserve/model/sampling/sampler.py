"""Pick one token per sampled sequence from its last-position logits.

Filters (temperature, top-k, top-p, min-p) run batched; the random draw runs
per row with that request's own generator, so a seeded request gets the same
tokens whatever else shares its batch. Nothing waits for the device until the
end: the step's tokens come to the host in one copy, not one per row.
"""

from __future__ import annotations

import torch

from kvserve.model.sampling.draw import draw
from kvserve.sampling_params import SamplingParams


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams | None],
    generators: list[torch.Generator | None],
    banned: list[set[int]] | None = None,
) -> list[int]:
    """One token per row of float32 `logits` [N, vocab]; None params means greedy.

    `banned` token ids per row are never picked: the stop tokens of a request
    that has not yet produced its `min_tokens`, unless they are all a grammar's
    mask left (then the grammar's end wins). Modifies `logits` in place.
    """
    if banned:
        for row, ids in enumerate(banned):
            if ids:
                cols = list(ids)
                kept = logits[row, cols].clone()
                logits[row, cols] = float("-inf")
                if not torch.isfinite(logits[row]).any():  # a grammar allows only its end:
                    logits[row, cols] = kept  # it ends the sequence, min_tokens or not
    sampled = [(i, p) for i, p in enumerate(params) if p is not None and p.temperature > 0]
    if not sampled:
        return logits.argmax(dim=-1).tolist()
    rows = [i for i, _ in sampled]
    every_row = len(rows) == logits.shape[0]  # then no copy of the rows, no argmax
    index = None if every_row else torch.tensor(rows, device=logits.device)
    chosen = logits if index is None else logits.index_select(0, index)
    probs = filtered_probs(chosen, [p for _, p in sampled])
    picked = draw(probs, [generators[row] for row in rows])  # one uniform per row
    if index is None:
        return picked.tolist()
    tokens = logits.argmax(dim=-1)
    tokens[index] = picked
    return tokens.tolist()  # the step's one device-to-host copy


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p (in that order)."""
    device = logits.device
    if any(p.temperature != 1.0 for p in params):
        temps = [p.temperature for p in params]
        logits = logits / torch.tensor(temps, device=device, dtype=logits.dtype)[:, None]
    vocab = logits.shape[-1]
    top_k = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
    top_p = [p.top_p for p in params]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _top_k_top_p(logits, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    min_p = [p.min_p for p in params]
    if any(m > 0 for m in min_p):
        floor = torch.tensor(min_p, device=device, dtype=probs.dtype)[:, None]
        keep = probs >= floor * probs.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits.masked_fill(~keep, float("-inf")), dim=-1)
    return probs


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) what falls outside the k most likely tokens or the top-p mass."""
    device = logits.device
    ordered, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=device)[None, :]
    drop = ranks >= torch.tensor(top_k, device=device)[:, None]
    ordered = ordered.masked_fill(drop, float("-inf"))
    probs = torch.softmax(ordered, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # The most likely token always survives: nothing comes before it (mass 0 < top_p).
    drop |= mass_before > torch.tensor(top_p, device=device, dtype=probs.dtype)[:, None]
    mask = torch.zeros_like(drop).scatter(-1, order, drop)
    return logits.masked_fill(mask, float("-inf"))
