"""A request as the scheduler sees it."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvserve.kvcache.sequence import CacheSequence


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    REJECTED = "rejected"

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass(slots=True, eq=False)
class Request(CacheSequence):
    """Prompt plus generated tokens, and how far their KV has been computed."""

    num_prompt_tokens: int = 0
    max_tokens: int = 16
    arrival_step: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    """Prompt tokens not computed at first admission (prefix hit); -1 before."""
    num_preemptions: int = 0
    error: str | None = None

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]
