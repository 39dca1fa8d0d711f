"""OpenAI's response bodies, built from the engine's DELTA outputs of one HTTP request.

A `Job` is one HTTP request: one `Part` per prompt (a completions batch has
several; chat has one), each with `n` choices. It accumulates what the engine
sent (text, token counts, cache hits) and renders the JSON answer, the SSE
chunks and the usage block, so completions.py only moves outputs around.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.serve.logprobs import Step, chat_logprobs, completion_logprobs
from kvserve.serve.protocol import ResponseOptions
from kvserve.serve.reasoning import ChatReasoning


@dataclass(slots=True)
class Part:
    """One prompt of the request and what its completions have produced so far."""

    index: int
    echo: str = ""
    """The prompt's text, put before each choice's text (`echo`)."""
    finished: bool = False
    texts: dict[int, str] = field(default_factory=dict)
    finish: dict[int, str | None] = field(default_factory=dict)
    started: set[int] = field(default_factory=set)
    """Completions whose first chunk went out (a stream sends the echo with it)."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated: int = 0
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    steps: dict[int, list[Step]] = field(default_factory=dict)
    """Per completion, each generated token's logprobs (when the client asked)."""
    offsets: dict[int, int] = field(default_factory=dict)
    """Per completion, where the next streamed token's text starts (completions logprobs)."""


@dataclass(slots=True)
class Job:
    request_id: str
    chat: bool
    model: str
    created: int
    n: int
    options: ResponseOptions
    outputs: asyncio.Queue[RequestOutput | BaseException]
    parts: dict[str, Part] = field(default_factory=dict)
    """Engine request id -> its prompt's part, in prompt order."""
    early: list[RequestOutput] = field(default_factory=list)
    """Outputs read while waiting for every prompt's first step; handed out first."""
    reasoning: ChatReasoning | None = None
    """Chat with `--reasoning-parser`: the answer split into reasoning and content."""

    # -- accumulating -------------------------------------------------------------

    def add(self, output: RequestOutput) -> list[tuple[int, CompletionOutput]]:
        """Count one output in; its completions with their choice index."""
        part = self.parts[output.request_id]
        part.prompt_tokens = len(output.prompt_token_ids)
        part.cached_tokens = output.num_cached_tokens
        indexed = []
        for c in output.outputs:
            part.generated += len(c.token_ids)
            part.texts[c.index] = part.texts.get(c.index, "") + c.text
            part.finish[c.index] = c.finish_reason or part.finish.get(c.index)
            if c.logprobs is not None:
                part.token_ids.setdefault(c.index, []).extend(c.token_ids)
                part.steps.setdefault(c.index, []).extend(c.logprobs)
            indexed.append((part.index * self.n + c.index, c))
        return indexed

    def _logprobs(
        self, part: Part, index: int, token_ids: list[int], steps: list[Step] | None
    ) -> dict[str, Any] | None:
        """The logprobs of these tokens of one choice, in the endpoint's shape (None: off)."""
        top = self.options.logprobs
        if top is None or steps is None:
            return None
        if self.chat:
            return chat_logprobs(token_ids, steps, top)
        start = part.offsets.get(index, len(part.echo))
        body, part.offsets[index] = completion_logprobs(token_ids, steps, top, start)
        return body

    def usage(self) -> dict[str, Any]:
        """Prompt tokens once per prompt (not per completion), as OpenAI counts them."""
        prompt = sum(p.prompt_tokens for p in self.parts.values())
        generated = sum(p.generated for p in self.parts.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": generated,
            "total_tokens": prompt + generated,
            "prompt_tokens_details": {
                "cached_tokens": sum(p.cached_tokens for p in self.parts.values())
            },
        }

    # -- the answer, whole ----------------------------------------------------------

    def body(self) -> dict[str, Any]:
        choices: list[dict[str, Any]] = []
        for part in self.parts.values():
            for j in range(self.n):
                choice: dict[str, Any] = {
                    "index": part.index * self.n + j,
                    "finish_reason": part.finish.get(j),
                    "logprobs": self._logprobs(
                        part, j, part.token_ids.get(j, []), part.steps.get(j, [])
                    ),
                }
                generated = part.texts.get(j, "")
                text = part.echo + generated
                if self.chat and self.reasoning is not None:
                    choice["message"] = self.reasoning.message(generated, part.echo)
                elif self.chat:
                    choice["message"] = {"role": "assistant", "content": text}
                else:
                    choice["text"] = text
                choices.append(choice)
        return {
            "id": self.request_id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
        }

    # -- the answer, streamed -------------------------------------------------------

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        body: dict[str, Any] = {
            "id": self.request_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.options.continuous_usage:
            body["usage"] = usage or self.usage()  # vLLM's continuous_usage_stats: every chunk
        elif self.options.include_usage:
            body["usage"] = usage  # null on every chunk but the last, as OpenAI sends it
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def first_chunk(self) -> str | None:
        """Chat streams open with the assistant's role, one choice each."""
        if not self.chat:
            return None
        choices = [
            {
                "index": part.index * self.n + j,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for part in self.parts.values()
            for j in range(self.n)
        ]
        return self.chunk(choices)

    def delta_chunk(self, output: RequestOutput) -> str | None:
        """The choices this output advanced; None when it carried nothing to send."""
        part = self.parts[output.request_id]
        choices = []
        for index, c in self.add(output):
            echo = ""
            if c.index not in part.started and (c.text or c.finish_reason):
                part.started.add(c.index)
                echo = part.echo
            text = echo + c.text
            if not text and c.finish_reason is None and not c.token_ids:
                continue
            logprobs = self._logprobs(part, c.index, c.token_ids, c.logprobs)
            choice: dict[str, Any] = {"index": index, "logprobs": logprobs}
            if self.chat and self.reasoning is not None:
                final = c.finish_reason is not None
                choice["delta"] = self.reasoning.delta(index, c.text, final, echo)
            elif self.chat:
                choice["delta"] = {"content": text} if text else {}
            else:
                choice["text"] = text
            choice["finish_reason"] = c.finish_reason
            choices.append(choice)
        return self.chunk(choices) if choices else None

    def abort_chunk(self) -> str:
        """The server stopped: every unfinished choice ends with finish_reason "abort"."""
        choices = []
        for part in self.parts.values():
            for j in range(self.n):
                if part.finish.get(j) is None:
                    choice: dict[str, Any] = {
                        "index": part.index * self.n + j,
                        "logprobs": None,
                        "finish_reason": "abort",
                    }
                    choice["delta" if self.chat else "text"] = {} if self.chat else ""
                    choices.append(choice)
        return self.chunk(choices)
