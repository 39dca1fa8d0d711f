"""A request as the engine and its scheduler see it (the KV cache keeps its own record)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.engine.detokenizer import OutputText
from kvserve.engine.speculative import SpecState
from kvserve.lora.request import Adapter
from kvserve.outputs import Logprob
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.structured.state import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"
    """The engine failed this request alone (its sampling, its stop check): the others go on."""
    REJECTED = "rejected"

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass(slots=True, eq=False)
class Request:
    """One sequence: prompt plus generated tokens, and how far their KV has been computed.

    A user request with `n` > 1 completions is n of these (`parent_id`,
    `index`). The scheduler owns the counters and appends generated tokens;
    the KV cache manager reads `token_ids` (it was given this list) and keeps
    blocks and hashes under `request_id` itself.
    """

    request_id: str
    token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    lora: Adapter | None = None
    """The LoRA adapter it runs with (kvserve.lora); None: the base model."""
    cache_salt: str | None = None
    parent_id: str = ""
    index: int = 0
    client_id: str = ""
    """The client request it belongs to (a batch of prompts or inputs is one): admission
    is round-robin between client requests (waiting_queue.py); default its parent_id."""
    priority: int = 0
    """vLLM's request priority: lower is admitted earlier (`--scheduling-policy priority`)."""
    num_prompt_tokens: int = 0
    arrival_step: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    """Prompt tokens not computed at first admission (prefix hit); -1 before."""
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    output_text: OutputText | None = None
    """The text grown token by token (StopChecker.prepare); None when nothing reads
    it before the request finishes."""
    logprobs: list[dict[int, Logprob]] | None = None
    """One entry per generated token when `params.logprobs` is set (the engine's
    LogprobsRecorder appends them); None otherwise."""
    cumulative_logprob: float = 0.0
    error: str | None = None
    """Why the engine failed it (status FINISHED_ERROR)."""
    grammar: GrammarState | None = None
    """Its own matcher when `params.structured_outputs` is set (kvserve.structured.state):
    the stop checker advances it, the runner reads it."""
    spec: SpecState | None = None
    """Its speculative decoding (acceptance, back-off) when the engine speculates and its
    sampling can be verified (kvserve.engine.drafter); None: it never drafts."""
    pooling: PoolingParams | None = None
    """Set on a pooling request: it prefills its prompt, samples nothing and finishes
    with its `embedding` (the runner pools the final hidden states)."""
    embedding: list[float] | None = None

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if not self.parent_id:
            self.parent_id = self.request_id
        if not self.client_id:
            self.client_id = self.parent_id

    @property
    def lora_name(self) -> str | None:
        """Its adapter's key in the KV cache, the tiers and the events: the adapter's
        content identity (kvserve.lora.request), never its name or id."""
        return None if self.lora is None else self.lora.identity

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]
