"""A user's request as the engine keeps it (its `n` sequences), and its output after a step.

The output is everything so far (CUMULATIVE), what is new (DELTA) or the final
one (FINAL_ONLY). A request the engine failed alone (a sequence finished with
FINISHED_ERROR) finishes whole: its other completions are aborted and the output
carries the error.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.stop import StopChecker
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import RequestOutputKind


@dataclass(slots=True)
class UserRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[Request]
    kind: RequestOutputKind
    sent_tokens: list[int]
    """Per sequence: output tokens (and their logprobs) already handed out (DELTA)."""

    @property
    def error(self) -> str | None:
        """Why the engine failed this request (a sequence's error), else None."""
        return next((seq.error for seq in self.sequences if seq.error is not None), None)

    def output(self, stop_checker: StopChecker) -> RequestOutput:
        """The request's output after a step. Text that may still be cut by a stop
        string is held back until the sequence finishes (OutputText.holdback)."""
        completions = []
        delta = self.kind is RequestOutputKind.DELTA
        for seq in self.sequences:
            done = seq.status.finished
            state = seq.output_text
            if seq.status is RequestStatus.FINISHED_ERROR:
                text = ""  # its text may be what failed: none is given
            elif state is not None:
                text = state.delta(done) if delta else state.text(done)
            else:  # no tokenizer, or FINAL_ONLY without stop strings: decode once
                text = stop_checker.final_text(seq) if done and not delta else ""
            sent = 0
            if delta:
                sent = self.sent_tokens[seq.index]
                self.sent_tokens[seq.index] = seq.num_output_tokens
            logprobs = seq.logprobs
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=seq.token_ids[seq.num_prompt_tokens + sent :],
                    finish_reason=seq.status.value if done else None,
                    stop_reason=seq.stop_reason,
                    logprobs=None if logprobs is None else logprobs[sent:],
                    cumulative_logprob=None if logprobs is None else seq.cumulative_logprob,
                )
            )
        return self._request_output(completions)

    def failed_output(self, error: str) -> RequestOutput:
        """The output of a request whose output could not be built: finished, the error."""
        completions = [
            CompletionOutput(index=seq.index, text="", token_ids=[], finish_reason="error")
            for seq in self.sequences
        ]
        output = self._request_output(completions)
        output.error = error
        return output

    def _request_output(self, completions: list[CompletionOutput]) -> RequestOutput:
        first = self.sequences[0]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids),
            outputs=completions,
            finished=all(c.finish_reason is not None for c in completions),
            num_cached_tokens=max(0, first.num_cached_tokens),
            error=self.error,
            embedding=first.embedding,
        )
