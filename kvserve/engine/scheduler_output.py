"""What one scheduler step hands on: its chunks (with their drafts) and the runner's view.

`SchedulerOutput.seq_chunks` wraps each scheduled chunk into the runner's
`SeqChunk` (with the manager's step plan); `sampled_tokens` and
`accepted_drafts` read the runner's `StepOutput` back for `Scheduler.update`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.batch import SeqChunk, StepOutput
from kvserve.engine.request import Request, RequestStatus
from kvserve.kvcache.manager import KVCacheManager


@dataclass(slots=True)
class ScheduledChunk:
    """`num_tokens` tokens of `request`, starting at position `start`, then its drafts."""

    request: Request
    start: int
    num_tokens: int
    draft_token_ids: list[int] | tuple[()] = ()
    """Speculative decoding: tokens proposed after the last one, verified by the step."""

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the sequence's last token (its logits are used)."""
        return self.start + self.num_tokens == len(self.request.token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    rejected: list[Request] = field(default_factory=list)

    def reject(self, request: Request, why: str) -> None:
        """`request` fails alone before it takes a block or a step (the scheduler's update
        finishes it, with `why` as its error): it can never run."""
        request.error = why
        request.status = RequestStatus.FINISHED_ERROR
        self.rejected.append(request)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    def seq_chunks(self, manager: KVCacheManager) -> list[SeqChunk]:
        """The step as a runner reads it: each request's tokens, its plan, sampling."""
        step_plan = manager.step_plan
        return [
            SeqChunk(
                request_id=c.request.request_id,
                token_ids=c.request.token_ids,
                plan=step_plan(c.request.request_id),
                sample=c.samples and c.request.pooling is None,
                params=c.request.params,
                num_generated=c.request.num_output_tokens,
                grammar=c.request.grammar,
                draft_token_ids=c.draft_token_ids,
                pooling=c.request.pooling,
                lora=c.request.lora,
            )
            for c in self.chunks
        ]


def sampled_tokens(chunks: list[SeqChunk], step: StepOutput) -> dict[str, int]:
    """Request id -> its new token, for every chunk that sampled (what `update` takes)."""
    return {c.request_id: t for c, t in zip(chunks, step.tokens, strict=True) if t is not None}


def accepted_drafts(chunks: list[SeqChunk], step: StepOutput) -> dict[str, int]:
    """Request id -> how many of its drafts the step accepted (chunks with drafts only)."""
    if step.num_accepted is None:
        return {}
    return {
        c.request_id: a for c, a in zip(chunks, step.num_accepted, strict=True) if c.draft_token_ids
    }
