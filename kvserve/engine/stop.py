"""When a generated token ends a sequence: EOS, stop token ids, stop strings, length.

Stop strings are matched on the output text, so the incremental detokenizer
runs here too: the scheduler's update calls `check` once per new token, and
that one call grows the text and applies every stop rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvserve.engine.detokenizer import (
    Decode,
    IncrementalDetokenizer,
    OutputText,
    decoder_for,
    skipped_ids,
)
from kvserve.engine.request import Request, RequestStatus
from kvserve.sampling_params import RequestOutputKind

_CONTEXT = 24
"""Prompt tokens a detokenizer may take its first context from (detokenizer.prompt_context)."""


class StopChecker:
    """Decides after each token, and owns each sequence's output text.

    The scheduler's update is its only caller during a step, so every stop
    rule lives here. A sequence gets an `OutputText` (detokenized token by
    token) only when something reads its text during the run: stop strings,
    or outputs every step (CUMULATIVE, DELTA). The others (FINAL_ONLY without
    stop strings, or no tokenizer) pay nothing per step; their text is decoded
    once at the end (`final_text`).
    """

    def __init__(self, tokenizer: Any | None, eos_token_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self._decoders: dict[bool, tuple[Decode, frozenset[int]]] = {}

    def _detokenizer(self, request: Request) -> IncrementalDetokenizer:
        skip = request.params.skip_special_tokens
        decoder = self._decoders.get(skip)
        if decoder is None:  # once per engine and setting
            skipped = skipped_ids(self.tokenizer) if skip else frozenset()
            decoder = self._decoders[skip] = (decoder_for(self.tokenizer, skip), skipped)
        n = request.num_prompt_tokens
        prompt = request.token_ids[max(0, n - _CONTEXT) : n]
        return IncrementalDetokenizer.after(decoder[0], prompt, decoder[1])

    def prepare(self, request: Request) -> None:
        """Give `request` its OutputText if its text is read before it finishes."""
        params = request.params
        if self.tokenizer is None or request.output_text is not None:
            return
        if not params.stop and params.output_kind is RequestOutputKind.FINAL_ONLY:
            return
        reach = max(map(len, params.stop)) - 1 if params.stop else 0
        request.output_text = OutputText(
            self._detokenizer(request),
            reach=reach,
            holdback=0 if params.include_stop_str_in_output else reach,
        )

    def check(self, request: Request, token: int) -> tuple[RequestStatus | None, int | str | None]:
        """After `token` was appended to `request`: (finish status or None, stop reason).

        A constrained request's grammar accepts the token first (the only place it
        advances); a grammar that ended stops the request.

        The text of a stop token is left out (unless include_stop_str_in_output);
        a stop string is matched in the text this token added (and, at the end,
        in the text still pending), cut from it unless include_stop_str_in_output.
        """
        params = request.params
        num_out = request.num_output_tokens
        status: RequestStatus | None = None
        reason: int | str | None = None
        grammar = request.grammar
        if grammar is not None:
            grammar.accept(token)  # a token the mask forbade raises: this request fails alone
            if grammar.terminated:  # its stop token: its text is left out as EOS's is
                status = RequestStatus.FINISHED_STOPPED
        if status is None and num_out >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                status = RequestStatus.FINISHED_STOPPED
            elif params.stop_token_ids and token in params.stop_token_ids:
                status, reason = RequestStatus.FINISHED_STOPPED, token
        if status is None and num_out >= params.max_tokens:
            status = RequestStatus.FINISHED_LENGTH
        text = request.output_text
        if text is None:
            return status, reason
        added = 0
        if status is not RequestStatus.FINISHED_STOPPED or params.include_stop_str_in_output:
            added = text.add(token)
        if status is not None:
            added += text.flush()
        if added and params.stop and num_out > params.min_tokens:
            stop = _match_stop(text, params.stop, added, params.include_stop_str_in_output)
            if stop is not None:
                return RequestStatus.FINISHED_STOPPED, stop
        return status, reason

    def final_text(self, request: Request) -> str:
        """The whole output text of a request that had no OutputText (one decode)."""
        if self.tokenizer is None:
            return ""
        ids = request.output_token_ids
        stopped = request.status is RequestStatus.FINISHED_STOPPED
        if stopped and not request.params.include_stop_str_in_output:
            ids = ids[:-1]  # the stop token (no stop strings here: nothing else stops)
        detokenizer = self._detokenizer(request)
        detokenizer.ids.extend(ids)
        return detokenizer.flush()


def _match_stop(text: OutputText, stops: Sequence[str], added: int, include: bool) -> str | None:
    """The stop string that the last `added` characters complete first, or None;
    the text is cut before it (after it when `include`).

    Only the tail can hold a new match: it must end in the added text, so it
    starts at most `reach` characters before it.
    """
    window = text.tail(added + text.reach)
    fresh = len(window) - added
    best: str | None = None
    best_end = len(window) + 1
    for stop in stops:
        at = window.find(stop, max(0, fresh - len(stop) + 1))
        if at >= 0 and at + len(stop) < best_end:
            best, best_end = stop, at + len(stop)
    if best is None:
        return None
    keep = best_end if include else best_end - len(best)
    text.cut(len(window) - keep)
    return best
