"""A sequence's logprobs: the runner's numbers for each sampled token, as the output's dicts.

The runner reports, per sampled token of a request that asked, the token's
logprob and rank and the top-k (kvserve.batch.TokenLogprobs); here each
becomes one `dict[int, Logprob]` (the sampled token first, then the top
tokens by rank) appended to the request's `logprobs`, with the token texts.
The request is the one owner of its list: a DELTA output is a slice of it.
"""

from __future__ import annotations

from typing import Any

from kvserve.batch import StepOutput
from kvserve.engine.detokenizer import Decode, decoder_for
from kvserve.engine.request import Request
from kvserve.outputs import Logprob


class LogprobsRecorder:
    """Appends a step's logprobs to the requests that asked; token texts cached by id."""

    def __init__(self, tokenizer: Any | None) -> None:
        self._decode: Decode | None = None if tokenizer is None else decoder_for(tokenizer, False)
        self._texts: dict[int, str] = {}
        """Token id -> its own text (bounded by the vocabulary)."""

    def record(self, requests: list[Request], step: StepOutput) -> None:
        """`requests`: the step's chunks' requests, in the order the runner saw them."""
        if step.logprobs is None:
            return
        for request, found, token in zip(requests, step.logprobs, step.tokens, strict=True):
            if found is None or token is None or request.logprobs is None:
                continue
            text = self.text
            entry = {token: Logprob(found.logprob, found.rank, text(token))}
            tops = zip(found.top_ids, found.top_logprobs, strict=True)
            for rank, (top, logprob) in enumerate(tops, 1):
                if top not in entry:
                    entry[top] = Logprob(logprob, rank, text(top))
            request.logprobs.append(entry)
            request.cumulative_logprob += found.logprob

    def text(self, token: int) -> str | None:
        """The token decoded alone (a piece of a character decodes to U+FFFD)."""
        if self._decode is None:
            return None
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self._decode([token])
        return text
