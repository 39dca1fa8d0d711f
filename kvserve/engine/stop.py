"""When a generated token ends a sequence: EOS, stop token ids, stop strings, length."""

from __future__ import annotations

from typing import Any

from kvserve.engine.request import Request, RequestStatus


class StopChecker:
    """Decides after each token; stop strings are matched on the decoded text.

    The scheduler's update is its only caller, so every stop rule lives here.
    Only requests with stop strings pay for detokenizing during the run; the
    text of the others is decoded once at the end.
    """

    def __init__(self, tokenizer: Any | None, eos_token_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids

    def check(
        self, request: Request, token: int
    ) -> tuple[RequestStatus | None, int | str | None, str | None]:
        """After `token` was appended to `request`: (finish status or None, stop
        reason, text when a stop string matched)."""
        params = request.params
        num_out = request.num_output_tokens
        if num_out >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED, None, None
            if params.stop_token_ids and token in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token, None
            if params.stop and self.tokenizer is not None:
                text = self.decode(request.output_token_ids)
                for stop in params.stop:
                    at = text.find(stop)
                    if at >= 0:
                        return RequestStatus.FINISHED_STOPPED, stop, text[:at]
        if num_out >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH, None, None
        return None, None, None

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
