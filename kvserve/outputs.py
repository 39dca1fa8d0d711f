"""What generate() returns, with vLLM's field names."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """One token's log-probability at one generated position.

    From the model's raw distribution: log_softmax of the float32 logits,
    before penalties, logit bias, temperature and the top-k/top-p/min-p
    filters (vLLM's default), so it says what the model thinks, not what the
    sampler drew from.
    """

    logprob: float
    rank: int
    """1-based rank of the token in that distribution (1: the most likely)."""
    decoded_token: str | None = None
    """The token's own text (a single-token decode); None without a tokenizer."""


@dataclass(slots=True)
class CompletionOutput:
    """One of the `n` completions of a request."""

    index: int
    text: str
    """The output text so far, or only what is new with RequestOutputKind.DELTA.
    Without the text of a stop token, and cut before a matched stop string,
    unless include_stop_str_in_output."""
    token_ids: list[int]
    """The generated token ids (a stop token included), or the new ones (DELTA)."""
    finish_reason: str | None = None
    """"stop" (EOS, stop token or stop string), "length", "abort", "error" (the engine
    failed this request alone: RequestOutput.error says why), or None while running."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended it, if any."""
    logprobs: list[dict[int, Logprob]] | None = None
    """With SamplingParams.logprobs: per generated token (or per new one with DELTA), the
    sampled token and the `logprobs` most likely ones (up to logprobs + 1 entries)."""
    cumulative_logprob: float | None = None
    """With SamplingParams.logprobs: the sum of the sampled tokens' logprobs so far."""

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    """Prompt tokens not computed for this request (prefix hits), first completion."""
    error: str | None = None
    """Set when the engine failed this request alone (a fault in its own step work, such
    as its sampling): it is finished, its other completions aborted."""
    embedding: list[float] | None = None
    """A pooling request's embedding (kvserve.pooling_params; one empty completion)."""


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]
    """The pooled final hidden states (L2-normalized unless the request said not to)."""


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt (vLLM's names: `output.outputs.embedding`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    num_cached_tokens: int = 0
    """Prompt tokens read from the prefix cache instead of computed."""
