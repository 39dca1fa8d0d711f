"""What generate() returns, with vLLM's field names."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    """"stop" (EOS, stop token or stop string), "length", "abort", or None while running."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended it, if any."""

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
