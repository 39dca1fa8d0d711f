"""What the engine hands a runner for one step, and what every runner provides.

The engine loop (kvserve.engine.llm_engine) drives any `Runner`: the torch
model runner (kvserve.model.runner) or the model-free one that `kvserve
simulate` uses (kvserve.engine.model_free_runner). Both read a step as a list
of `SeqChunk`s, each wrapping the KV cache's `StepPlan` for one request, and
answer with a `StepOutput`: the sampled tokens, and log-probabilities for the
chunks whose request asked for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kvserve.kvcache.plan import StepPlan
from kvserve.kvcache.specs import KVCacheSpec
from kvserve.lora.request import Adapter
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import SamplingParams


class GrammarRow(Protocol):
    """What a runner reads of a constrained sequence: the tokens allowed next."""

    def fill(self, bitmask: Any, row: int) -> None:
        """Write the allowed tokens into row `row` of an int32 bitmask [rows, words]."""
        ...


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
    """Tokens this request has generated so far (the last ones of `token_ids`, which the
    presence and frequency penalties count): below `params.min_tokens` no stop token
    (eos unless ignore_eos, stop_token_ids) can be sampled."""
    grammar: GrammarRow | None = None
    """The sequence's grammar state (kvserve.structured.state) when its output is
    constrained: the runner reads it to mask the row's logits, never advances it."""
    draft_token_ids: Sequence[int] = ()
    """Speculative decoding: draft tokens after the sequence's last token, computed at
    the plan's last `num_lookahead_tokens` positions. The runner verifies them: its
    token for the chunk follows the drafts it accepts (`StepOutput.num_accepted`)."""
    pooling: PoolingParams | None = None
    """A pooling request's rule (its chunks never sample): the runner pools the final
    hidden states of its prompt instead (kvserve.model.pooling)."""
    lora: Adapter | None = None
    """The LoRA adapter its rows run with (kvserve.lora); None: the base model."""

    @property
    def new_token_ids(self) -> Sequence[int]:
        """The tokens this step computes (the drafts last)."""
        plan = self.plan
        if not self.draft_token_ids:
            return self.token_ids[plan.start : plan.end]
        own = self.token_ids[plan.start : plan.end - len(self.draft_token_ids)]
        return [*own, *self.draft_token_ids]


@dataclass(slots=True)
class TokenLogprobs:
    """What a runner reports for one sampled token of a request that asked for logprobs.

    From the raw distribution (log_softmax of the logits before any penalty,
    bias, temperature or filter). The engine turns it into the output's
    `dict[int, Logprob]` (kvserve.engine.logprobs).
    """

    logprob: float
    """The sampled token's."""
    rank: int
    """The sampled token's 1-based rank."""
    top_ids: list[int]
    """The `params.logprobs` most likely tokens, most likely first (rank i + 1)."""
    top_logprobs: list[float]


@dataclass(slots=True)
class StepOutput:
    """A runner's answer for one step, aligned with the chunks it was given."""

    tokens: list[int | None]
    """The sampled token of each chunk (None where sample=False)."""
    logprobs: list[TokenLogprobs | None] | None = None
    """Per chunk, for the sampled chunks whose params ask for logprobs; None when no
    chunk of the step asked (the common case costs nothing)."""
    num_accepted: list[int] | None = None
    """Per chunk, how many of its draft tokens were accepted (they come before its token
    in `tokens`); None when no chunk of the step had drafts."""
    errors: dict[int, str] | None = None
    """Chunk index -> why its row failed (its token is None): the engine fails that
    request alone and the step's other tokens stand. None when every row sampled."""
    embeddings: dict[int, list[float]] | None = None
    """Chunk index -> the pooled embedding of a pooling chunk that ended its prompt;
    None when no chunk of the step pooled (a runner without a model never pools)."""


class Runner(Protocol):
    """The engine's view of a runner: its KV cache layout, and one step at a time."""

    kv_cache_specs: list[KVCacheSpec]
    """One spec per KV cache group, in the order of the plans' block tables."""
    num_blocks: int
    hash_block_size: int
    eos_token_ids: set[int]
    vocab_size: int

    @property
    def max_model_len(self) -> int | None: ...

    @property
    def model_dir(self) -> Path | None:
        """The checkpoint path (a Hugging Face directory or a GGUF file); None without a model."""
        ...

    @property
    def tokenizer(self) -> Any | None: ...

    def execute(self, chunks: list[SeqChunk]) -> StepOutput:
        """Run one step: the sampled token of each chunk, and logprobs for every sampled
        chunk whose params ask (the engine keeps one entry per generated token)."""
        ...

    def free_request(self, request_id: str) -> None:
        """Forget per-request state (a finished or aborted request)."""
        ...

    def release(self) -> None:
        """Give back what the runner holds (weights, K/V): the engine shuts down."""
        ...
