"""A draft model for speculative decoding: a smaller checkpoint that shares the target's
tokenizer proposes the next tokens; the target verifies them in one step.

Its K/V follows the target's KV cache rules without a manager of its own:
each draft layer has (K, V) tensors indexed by the SAME block ids as the
target's first full-attention group (same block size, same pool size: the
model runner loads the draft first and counts its share in every block), so
the target's one `KVCacheManager` allocates, hashes, shares, evicts and
frees the draft's K/V with the target's. That holds because the draft
writes K/V at every position the target computes, in the same step, into
the same slots:

- each step it runs every scheduled chunk's tokens (prefill chunks,
  decodes, recomputed preempted requests; the target's `skip_write_until`
  too), so a block the target caches holds the draft's K/V as well and a
  prefix hit is a hit for both (the plans' copy-on-write copies arise only
  in Mamba hybrids, which refuse speculation);
- then, for each chunk with k lookahead slots, k more one-token passes:
  pass j feeds draft j-1 at its lookahead position and proposes draft j
  (its argmax); the last pass only writes the last draft's K/V. So every
  draft the target accepts has the draft's K/V too, and a rejected one's
  slot is rewritten by the next step before anything reads it (the same
  rule as the target's).

The draft proposes its argmax: a drafter that proposes one token with
certainty, which `verify_sampled` keeps exact at temperature > 0 (at the
cost of a lower acceptance than sampling the draft would give).

Written here because the drafts must live in this engine's paged pool and
plans; the model itself is any checkpoint the loader reads.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

import torch

from kvserve.batch import SeqChunk
from kvserve.kvcache.specs import FullAttentionSpec, KVCacheSpec
from kvserve.model.attention.step_metadata import METADATA_BUILDERS
from kvserve.model.checkpoint.config import ModelConfig
from kvserve.model.checkpoint.resolve import resolve_checkpoint
from kvserve.model.checkpoint.tokenizer import load_tokenizer
from kvserve.model.loader import load_model
from kvserve.model.memory.kv_memory import allocate_kv_caches, bytes_per_block
from kvserve.model.models import DecoderForCausalLM


class TargetRunner(Protocol):
    """What the draft reads of its target (kvserve.model.runner.ModelRunner): a protocol, so
    the runner imports this module and not the other way round."""

    @property
    def attention_backend(self) -> str: ...
    @property
    def block_size(self) -> int: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def exact(self) -> bool: ...
    @property
    def kv_cache_specs(self) -> list[KVCacheSpec]: ...
    @property
    def quantization(self) -> str: ...
    @property
    def tokenizer(self) -> Any: ...
    @property
    def vocab_size(self) -> int: ...


logger = logging.getLogger(__name__)

Span = tuple[int, int, tuple[int, ...], int]
"""(start, num_tokens, block table, skip_write_until): one chunk, for the metadata."""


class DraftModel:
    """The draft checkpoint, its K/V tensors in the target's block layout, and `propose`."""

    def __init__(self, model_dir: str | Path, target: TargetRunner) -> None:
        """Load and check the draft beside `target`, the target's ModelRunner (its dtype,
        device, quantization where the draft's format allows it, specs and block size),
        before the target sizes its pool (`page_bytes` is part of each block); `allocate`
        then gives it K/V for the pool's blocks."""
        quantization = target.quantization  # the target's packing, where the draft has it
        if quantization == "gguf" and resolve_checkpoint(model_dir).gguf is None:
            quantization = "none"
        model, config = load_model(
            model_dir, target.dtype, target.device, quantization, target.exact
        )
        if config.layer_kinds and "mamba" in config.layer_kinds:
            raise ValueError(
                "speculative_config: the draft model keeps Mamba state, which cannot be "
                "rewound past a rejected draft; use an attention-only draft"
            )
        check_same_vocabulary(model_dir, config, target)
        groups = [
            g for g, spec in enumerate(target.kv_cache_specs) if isinstance(spec, FullAttentionSpec)
        ]
        if not groups:
            raise ValueError(
                "speculative_config: method 'draft_model' needs a target with a full-attention "
                "layer (the draft's layers read every position through its block table)"
            )
        self.model: DecoderForCausalLM | None = model
        self.config = config
        self.max_positions: int = config.max_position_embeddings
        self.group = groups[0]
        """The target's KV cache group whose block tables the draft's layers use."""
        self.block_size: int = target.block_size
        self.device: torch.device = target.device
        self.backend: str = target.attention_backend
        self.windows: list[int | None] = config.layer_windows or [None] * config.num_layers
        """Per draft layer, its sliding window (masked in attention; the table is full)."""
        self.dtype: torch.dtype = target.dtype
        self.page_bytes = bytes_per_block(config, self.block_size, self.dtype)
        """The draft's K/V bytes of one block (the target's pool counts them per block)."""
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        """One (K, V) pair per draft layer: [num_blocks, block_size, heads, head_dim]."""
        logger.info("draft model %s: %d layer(s)", model_dir, config.num_layers)

    def allocate(self, num_blocks: int) -> None:
        """K/V for each of the pool's `num_blocks` blocks (one pair per draft layer)."""
        self.kv_caches = allocate_kv_caches(
            self.config, num_blocks, self.block_size, self.dtype, self.device
        )

    def release(self) -> None:
        """Drop the weights and K/V (the engine's shutdown)."""
        self.kv_caches.clear()
        self.model = None

    def propose(self, chunks: list[SeqChunk]) -> dict[int, list[int]]:
        """Run the step's tokens through the draft, then draft each chunk that has lookahead
        slots (its `draft_token_ids` says how many); chunk index -> its draft tokens."""
        if self.model is None or not self.kv_caches:
            raise RuntimeError("the draft model has no K/V (released, or never allocated)")
        with torch.inference_mode():
            spans: list[Span] = []
            input_ids: list[int] = []
            rows: dict[int, int] = {}  # chunk index -> row of its last real token
            for i, chunk in enumerate(chunks):
                plan = chunk.plan
                num_drafts = len(chunk.draft_token_ids)
                end = plan.end - num_drafts
                table = plan.block_ids[self.group]
                spans.append((plan.start, end - plan.start, table, plan.skip_write_until))
                input_ids.extend(chunk.token_ids[plan.start : end])
                if num_drafts:
                    rows[i] = len(input_ids) - 1
            hidden = self._forward(input_ids, spans)  # always: its K/V follows the target's
            if not rows:
                return {}
            first = self._argmax(hidden[list(rows.values())])
            drafts = {i: [token] for i, token in zip(rows, first, strict=True)}
            self._autoregress(chunks, drafts)
        return drafts

    def _autoregress(self, chunks: list[SeqChunk], drafts: dict[int, list[int]]) -> None:
        """Passes 1..k: feed each chunk's latest draft at its lookahead slot; a chunk whose
        k drafts are all there gets one last pass that only writes the last one's K/V."""
        sizes = {i: len(chunks[i].draft_token_ids) for i in drafts}
        for step in range(1, max(sizes.values()) + 1):
            active = [i for i, size in sizes.items() if size >= step]
            spans: list[Span] = []
            for i in active:
                plan = chunks[i].plan
                position = plan.end - sizes[i] + step - 1  # draft step - 1's slot
                spans.append((position, 1, plan.block_ids[self.group], 0))
            hidden = self._forward([drafts[i][-1] for i in active], spans)
            proposing = [row for row, i in enumerate(active) if sizes[i] > step]
            if proposing:
                tokens = self._argmax(hidden[proposing])
                for row, token in zip(proposing, tokens, strict=True):
                    drafts[active[row]].append(token)

    def _forward(self, input_ids: list[int], spans: list[Span]) -> torch.Tensor:
        """The draft over the flattened tokens; K/V written at the spans' slots."""
        build = METADATA_BUILDERS[self.backend]
        metas = {
            window: build(spans, self.block_size, self.device, window)
            for window in set(self.windows)
        }
        positions = [p for start, num, _, _ in spans for p in range(start, start + num)]
        assert self.model is not None  # propose checked
        hidden: torch.Tensor = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            self.kv_caches,
            [metas[window] for window in self.windows],
        )
        return hidden

    def _argmax(self, hidden: torch.Tensor) -> list[int]:
        """The draft's greedy token for each row of hidden states."""
        assert self.model is not None  # propose checked
        tokens: list[int] = self.model.compute_logits(hidden).argmax(dim=-1).tolist()
        return tokens


def check_same_vocabulary(model_dir: str | Path, config: ModelConfig, target: TargetRunner) -> None:
    """A ValueError unless the draft's token ids mean the target's: the same vocabulary size
    and, where both checkpoints carry a tokenizer, the same token -> id map."""
    if config.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config: the draft model's vocabulary has {config.vocab_size} "
            f"tokens, the target's {target.vocab_size}: a draft must share the target's "
            "tokenizer"
        )
    draft_tokenizer = load_tokenizer(model_dir, config)
    target_tokenizer = target.tokenizer
    if (draft_tokenizer is None) != (target_tokenizer is None):
        raise ValueError(
            "speculative_config: only one of the draft and target checkpoints has a "
            "tokenizer: a draft must share the target's tokenizer"
        )
    if draft_tokenizer is None or target_tokenizer is None:
        return
    if draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(
            "speculative_config: the draft model's tokenizer maps tokens to other ids than "
            "the target's: a draft must share the target's tokenizer"
        )
