"""What the engine hands a runner for one step, and what every runner provides.

The engine loop (kvserve.engine.llm_engine) drives any `Runner`: the torch
model runner (kvserve.model.runner) or the model-free one that `kvserve
simulate` uses (kvserve.engine.model_free_runner). Both read a step as a list
of `SeqChunk`s, each wrapping the KV cache's `StepPlan` for one request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kvserve.kvcache.plan import StepPlan
from kvserve.kvcache.specs import KVCacheSpec
from kvserve.sampling_params import SamplingParams


@dataclass(slots=True)
class SeqChunk:
    """One request's share of a step: its tokens, its KV plan, how to sample."""

    request_id: str
    token_ids: Sequence[int]
    """The request's tokens so far (prompt + generated, read only); this step computes
    positions [plan.start, plan.end)."""
    plan: StepPlan
    sample: bool = True
    """Sample from the logits of the chunk's last token (False for a non-final prefill chunk)."""
    params: SamplingParams | None = None
    """None means greedy."""
    generator: Any = None
    """A torch.Generator overriding the one the runner keeps for a seeded request."""
    num_generated: int = 0
    """Tokens this request has generated so far: below `params.min_tokens` no stop token
    (eos unless ignore_eos, stop_token_ids) can be sampled."""

    @property
    def new_token_ids(self) -> Sequence[int]:
        """The tokens this step computes."""
        return self.token_ids[self.plan.start : self.plan.end]


class Runner(Protocol):
    """The engine's view of a runner: its KV cache layout, and one step at a time."""

    kv_cache_specs: list[KVCacheSpec]
    """One spec per KV cache group, in the order of the plans' block tables."""
    num_blocks: int
    hash_block_size: int
    eos_token_ids: set[int]
    vocab_size: int
    max_model_len: int | None
    model_dir: Path | None
    """The checkpoint path (a Hugging Face directory or a GGUF file); None without a model."""

    @property
    def tokenizer(self) -> Any | None: ...

    def execute(self, chunks: list[SeqChunk]) -> list[int | None]:
        """Run one step; the sampled token of each chunk (None where sample=False)."""
        ...

    def free_request(self, request_id: str) -> None:
        """Forget per-request state (a finished or aborted request)."""
        ...
