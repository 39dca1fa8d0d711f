"""Log-probabilities in OpenAI's two shapes, from the engine's per-token `Logprob` dicts.

Completions use the legacy shape (parallel lists: tokens, token_logprobs,
top_logprobs, text_offset); chat uses `{"content": [{token, logprob, bytes,
top_logprobs}]}`. Each generated token's dict holds the sampled token and
the most likely ones (kvserve.outputs.Logprob, with their rank); `top` says
how many of those the client asked to see. A token without a tokenizer is
named `token_id:N`, as vLLM names it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvserve.outputs import Logprob

Step = dict[int, Logprob]


def token_text(token_id: int, entry: Logprob) -> str:
    return entry.decoded_token if entry.decoded_token is not None else f"token_id:{token_id}"


def _top(step: Step, top: int) -> list[tuple[int, Logprob]]:
    """The `top` most likely tokens of one step, most likely first."""
    ranked = sorted(step.items(), key=lambda item: item[1].rank)
    return [(t, e) for t, e in ranked if e.rank <= top]


def completion_logprobs(
    token_ids: Sequence[int], steps: Sequence[Step], top: int, offset: int
) -> tuple[dict[str, Any], int]:
    """The legacy shape for these tokens; `offset` is where their text starts in the
    choice's text. Returns it and the offset after them (for the next chunk)."""
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []
    for token_id, step in zip(token_ids, steps, strict=True):
        chosen = step[token_id]
        text = token_text(token_id, chosen)
        tokens.append(text)
        token_logprobs.append(chosen.logprob)
        shown = {token_text(t, e): e.logprob for t, e in _top(step, top)}
        shown.setdefault(text, chosen.logprob)  # the sampled token is always there
        top_logprobs.append(shown)
        text_offset.append(offset)
        offset += len(text)
    body = {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }
    return body, offset


def chat_logprobs(token_ids: Sequence[int], steps: Sequence[Step], top: int) -> dict[str, Any]:
    """The chat shape for these tokens: each with its `top` most likely alternatives."""

    def entry(token_id: int, e: Logprob) -> dict[str, Any]:
        text = token_text(token_id, e)
        return {"token": text, "logprob": e.logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for token_id, step in zip(token_ids, steps, strict=True):
        item = entry(token_id, step[token_id])
        item["top_logprobs"] = [entry(t, e) for t, e in _top(step, top)]
        content.append(item)
    return {"content": content}
