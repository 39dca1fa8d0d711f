"""Logit bias and repetition, presence and frequency penalties, batched over the rows that use them.

They change the logits before temperature and the filters (and before the
greedy argmax), in vLLM's order: bias first, then the repetition penalty
(over prompt + generated tokens, the CTRL rule: a seen token's positive
logit is divided by it, a negative one multiplied), then presence and
frequency (over the generated tokens: logit -= presence * (count > 0) +
frequency * count). Rows whose params change nothing are never gathered, so
a step without penalties pays one attribute check per row.

The runner keeps no per-request state for them: the counts are rebuilt from
the chunk's token ids each step (O(sequence length) for the rows that ask).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.batch import SeqChunk


def apply_penalties(logits: torch.Tensor, chunks: Sequence[SeqChunk]) -> None:
    """Adjust, in place, the rows of float32 `logits` [N, vocab] (one per chunk) that ask."""
    asking = [
        (i, p) for i, c in enumerate(chunks) if (p := c.params) is not None and p.adjusts_logits
    ]
    if not asking:
        return
    rows = [i for i, _ in asking]
    params = [p for _, p in asking]
    device = logits.device
    vocab = logits.shape[-1]
    adjusted = logits[rows]
    bias_rows, bias_ids, bias_values = [], [], []
    for j, p in enumerate(params):
        for token, value in (p.logit_bias or {}).items():
            bias_rows.append(j)
            bias_ids.append(token)
            bias_values.append(value)
    if bias_rows:
        index = (torch.tensor(bias_rows, device=device), torch.tensor(bias_ids, device=device))
        values = torch.tensor(bias_values, device=device, dtype=adjusted.dtype)
        adjusted.index_put_(index, values, accumulate=True)
    repetition = [p.repetition_penalty for p in params]
    if any(r != 1.0 for r in repetition):
        seen = _counts([chunks[i].token_ids for i in rows], vocab, device) > 0
        penalty = torch.tensor(repetition, device=device, dtype=adjusted.dtype)[:, None]
        scaled = torch.where(adjusted > 0, adjusted / penalty, adjusted * penalty)
        adjusted = torch.where(seen, scaled, adjusted)
    presence = [p.presence_penalty for p in params]
    frequency = [p.frequency_penalty for p in params]
    if any(presence) or any(frequency):
        generated = [_generated(chunks[i]) for i in rows]
        counts = _counts(generated, vocab, device).to(adjusted.dtype)
        presence_t = torch.tensor(presence, device=device, dtype=adjusted.dtype)[:, None]
        frequency_t = torch.tensor(frequency, device=device, dtype=adjusted.dtype)[:, None]
        adjusted -= frequency_t * counts + presence_t * (counts > 0)
    logits[rows] = adjusted


def _generated(chunk: SeqChunk) -> Sequence[int]:
    """The tokens the request generated so far (the tail of its sequence)."""
    ids = chunk.token_ids
    return ids[len(ids) - chunk.num_generated :] if chunk.num_generated else ()


def _counts(sequences: list[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """How often each token occurs in each sequence: [len(sequences), vocab] int32."""
    width = max(1, max(len(s) for s in sequences))
    # Padding goes to an extra column (id `vocab`) that is cut off afterwards.
    ids = torch.full((len(sequences), width), vocab, dtype=torch.long)
    for row, seq in enumerate(sequences):
        if seq:
            ids[row, : len(seq)] = torch.as_tensor(list(seq), dtype=torch.long)
    ids = ids.to(device)
    counts = torch.zeros((len(sequences), vocab + 1), dtype=torch.int32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.int32))
    return counts[:, :vocab]
