"""What every handler shares: the engine thread, the served names, the key, the limits.

Owned by the event loop: the counters here (`queued`, `draining`) change only
on it, and so does the log of ignored fields: they need no lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.lora.request import LoRARequest
from kvserve.serve.http.adapters import ServedAdapters
from kvserve.serve.http.engine_thread import EngineThread
from kvserve.serve.http.errors import APIError
from kvserve.serve.http.limits import ServeLimits
from kvserve.serve.http.metrics import ServerMetrics
from kvserve.serve.http.tokenizer_worker import TokenizerWorker
from kvserve.serve.request.fields import IgnoredLog
from kvserve.serve.responses_api.store import RESPONSES_STORE_SIZE, ResponseStore
from kvserve.tool_calls.parser import ToolParser
from kvserve.tool_calls.registry import parser_for

RETRY_AFTER_SECONDS = 1


@dataclass(slots=True)
class ServerState:
    engine: EngineThread
    served_name: str
    """The one model name clients use (`--served-model-name`, else the model as given)."""
    description: str
    """Which checkpoint runs (kvserve.default_model.ResolvedModel.description)."""
    api_key: str | None = None
    max_model_len: int | None = None
    max_request_tokens: int | None = None
    """Prompt + output tokens one request can hold: max_model_len, or fewer when the KV pool
    holds fewer (Scheduler.max_request_tokens); chat without max_tokens runs to it."""
    metrics: ServerMetrics | None = None
    max_queued_requests: int | None = None
    """Requests allowed to wait for their first step; beyond it a 503 (None: no limit)."""
    log_requests: bool = False
    """Log each request's prompt and parameters (off: logs never hold prompt text)."""
    kv_metadata: dict[str, Any] | None = None
    """What GET /kv-metadata answers (http/kv_metadata.py): a router predicts hits from it."""
    queued: int = 0
    """Requests submitted that have not had their first step yet."""
    draining: bool = False
    """Shutting down: new requests get a 503, running ones finish."""
    ignored_log: IgnoredLog = field(default_factory=IgnoredLog)
    """The ignored request fields already warned about (each name once)."""
    limits: ServeLimits = field(default_factory=ServeLimits)
    responses: ResponseStore = field(default_factory=lambda: ResponseStore(RESPONSES_STORE_SIZE))
    """/v1/responses kept for GET, DELETE and previous_response_id (event-loop owned)."""
    pooling: str = "last"
    """How /v1/embeddings pools the final hidden states (`--pooling`: last or mean)."""
    reasoning_parser: str | None = None
    """`--reasoning-parser` (kvserve.reasoning): chat answers split into reasoning and
    content; None: the whole answer is content."""
    tokenizer: TokenizerWorker | None = None
    """The tokenizer's worker thread (built from the engine's tokenizer when None)."""
    tool_call_parser: str | None = None
    """`--tool-call-parser` (None: the chat template's family, else hermes)."""
    tool_parser: ToolParser | None = None
    """How this checkpoint's tool calls are written and read (tool_calls.registry)."""
    adapters: ServedAdapters | None = None
    """The LoRA adapters served by name (`--enable-lora`); None: the base model alone."""

    def __post_init__(self) -> None:
        if self.tokenizer is None:
            self.tokenizer = TokenizerWorker(self.engine.engine.tokenizer, self.max_model_len)
        if self.tool_parser is None:
            template = getattr(self.tokenizer.tokenizer, "chat_template", None)
            self.tool_parser = parser_for(self.tool_call_parser, template)

    @property
    def tokens(self) -> TokenizerWorker:
        assert self.tokenizer is not None
        return self.tokenizer

    @property
    def max_n(self) -> int:
        """The most completions per prompt (`--max-n`; default the engine's max_num_seqs)."""
        if self.limits.max_n is not None:
            return self.limits.max_n
        return self.engine.engine.scheduler.config.max_num_seqs

    @property
    def scheduling_policy(self) -> str:
        """`--scheduling-policy`: fcfs or priority (what a request's `priority` may be)."""
        return self.engine.engine.scheduler.config.scheduling_policy

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary: prompt token ids and logit_bias ids are below it."""
        return int(self.engine.engine.runner.vocab_size)

    @property
    def healthy(self) -> bool:
        """Serving: not draining, and the engine thread alive."""
        return not self.draining and self.engine.dead is None

    def check_model(self, name: object) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model, or `model` left out);
        naming a model not served is a 404, as OpenAI answers."""
        if name is None or name == self.served_name:
            return None
        if not isinstance(name, str):
            raise APIError("model must be a string", param="model")
        served = None if self.adapters is None else self.adapters.get(name)
        if served is not None:
            return served.request
        names = ", ".join(repr(n) for n in self.model_names()[:20])
        raise APIError(
            f"the model {name[:200]!r} does not exist; this server serves {names}",
            404,
            param="model",
            code="model_not_found",
        )

    def model_names(self) -> list[str]:
        """The base model's served name, then each adapter's."""
        return [self.served_name, *([] if self.adapters is None else self.adapters.names())]

    def answer_name(self, name: object) -> str:
        """The `model` an answer carries: the name the client asked for (checked), as vLLM."""
        return name if isinstance(name, str) and name else self.served_name

    def check_admission(self, num_requests: int = 1) -> None:
        """A 503 (with Retry-After) while draining, or when the wait queue is full."""
        if self.engine.dead is not None:
            dead = self.engine.dead
            raise APIError(f"the engine is dead ({dead}); the server is restarting", 503)
        if self.draining:
            raise APIError("the server is shutting down", 503, headers=_RETRY)
        limit = self.max_queued_requests
        if limit is not None and self.queued + num_requests > limit:
            raise APIError(
                f"too many requests waiting ({self.queued}; --max-queued-requests {limit}); "
                "retry later",
                503,
                headers=_RETRY,
            )


_RETRY = {"Retry-After": str(RETRY_AFTER_SECONDS)}
