"""Teacher-forced logits of one text and the numbers that compare two models on it.

The runner samples only the last position of a chunk; accuracy tests need the
logits at every position of a long text. `teacher_forced_logits` runs one
prefill step of the whole text through a model with the runner's own KV
tensors and metadata (blocks 1..n; a Mamba state from zeros), the same path a
prompt takes.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from kvserve.kvcache.specs import MambaStateSpec
from kvserve.model import ModelRunner
from kvserve.model.attention.attention_metadata import AttentionMetadata
from kvserve.model.layers.mamba2 import StateMetadata, StateSegment

TEXT = (Path(__file__).parent / "data" / "lighthouse.txt").read_text()
"""Five paragraphs of plain English written for these tests: 602 SmolLM2 tokens."""


def teacher_forced_logits(
    runner: ModelRunner, token_ids: list[int], model: nn.Module
) -> torch.Tensor:
    """[T, vocab] float32 logits of `model` (built for `runner`'s checkpoint) at every position."""
    blocks = list(range(1, -(-len(token_ids) // runner.block_size) + 1))
    state_page = len(blocks) + 1  # a Mamba layer's state, from zeros, ends here
    assert state_page < runner.num_blocks, "the runner's KV cache is too small for the text"
    span = [(0, len(token_ids), blocks, 0)]
    group_metas = [
        StateMetadata([StateSegment(0, len(token_ids), 0, state_page)])
        if isinstance(spec, MambaStateSpec)
        else AttentionMetadata.build(
            span, runner.block_size, runner.device, getattr(spec, "sliding_window", None)
        )
        for spec in runner.kv_cache_specs
    ]
    metas = [group_metas[g] for g in runner.layer_groups.layer_group]
    with torch.inference_mode():
        ids = torch.tensor(token_ids, device=runner.device)
        hidden = model(
            ids, torch.arange(len(token_ids), device=runner.device), runner.kv_caches, metas
        )
        return model.compute_logits(hidden)


def top1_agreement(logits: torch.Tensor, reference: torch.Tensor) -> float:
    """The fraction of positions whose most likely next token is the reference's."""
    return (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()


def perplexity(logits: torch.Tensor, token_ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of each next token of the text."""
    targets = torch.tensor(token_ids[1:])
    nll = nn.functional.cross_entropy(logits[:-1].float(), targets)
    return math.exp(nll.item())
