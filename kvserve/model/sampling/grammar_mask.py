"""Constrained rows' token bitmasks applied to their logits, before anything else changes them.

Each constrained row's grammar state (kvserve.structured.state, owned by the
engine) fills its row of one int32 bitmask; xgrammar's kernel (its CPU one on
the CPU) sets every token the grammar forbids to -inf, padding columns past
the tokenizer's vocabulary included. Penalties, bias, temperature and the
filters then see only allowed tokens. A step without constrained rows pays one
attribute check per row and never imports xgrammar.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.batch import SeqChunk


def apply_grammar(logits: torch.Tensor, chunks: Sequence[SeqChunk]) -> None:
    """Mask, in place, the rows of float32 `logits` [N, vocab] whose chunk has a grammar."""
    grammars = [(i, c.grammar) for i, c in enumerate(chunks) if c.grammar is not None]
    if not grammars:
        return
    import xgrammar as xgr

    vocab = logits.shape[-1]
    bitmask = torch.full((len(chunks), (vocab + 31) // 32), -1, dtype=torch.int32)
    for i, grammar in grammars:
        grammar.fill(bitmask, i)
    rows = [i for i, _ in grammars]
    bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=rows)
