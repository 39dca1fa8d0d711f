"""OpenAI's response bodies, built from the engine's DELTA outputs of one HTTP request.

A `Job` is one HTTP request: one `Part` per prompt (a completions batch has
several; chat has one), each with `n` choices. It accumulates what the engine
sent (text, token counts, cache hits) and renders the JSON answer, the SSE
chunks and the usage block, so submit.py and stream.py only move outputs around.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.serve.generation.logprobs import Step, chat_logprobs, completion_logprobs
from kvserve.serve.request.protocol import ResponseOptions
from kvserve.serve.request.reasoning import ChatReasoning
from kvserve.tool_calls.parser import ToolParser
from kvserve.tool_calls.stream import ToolCallStream
from kvserve.tool_calls.types import ParsedOutput, ToolCall


@dataclass(slots=True)
class ChatChoice:
    """One chat choice, whole: the plain data the JSON answer is built from (and what
    another API's translation reads: the text and the parsed tool calls)."""

    index: int
    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str | None
    """"tool_calls" when the model called and then stopped."""
    logprobs: dict[str, Any] | None = None
    stop_reason: int | str | None = None
    """The stop string or token id that ended it (vLLM's `stop_reason`)."""
    reasoning_content: str | None = None
    """The thinking of a reasoning model's answer (`--reasoning-parser`), apart from it."""
    reasons: bool = False
    """Read by a reasoning parser: the message has `reasoning_content` (null when none)."""

    def as_openai(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [call.as_openai() for call in self.tool_calls]
        if self.reasons:
            message["reasoning_content"] = self.reasoning_content
        return {
            "index": self.index,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            "logprobs": self.logprobs,
            "message": message,
        }


@dataclass(slots=True)
class Part:
    """One prompt of the request and what its completions have produced so far."""

    index: int
    echo: str = ""
    """The prompt's text, put before each choice's text (`echo`)."""
    finished: bool = False
    texts: dict[int, list[str]] = field(default_factory=dict)
    """Per completion, its text as the pieces it came in (joined once, by `text`: adding a
    delta costs the delta, however long the answer already is)."""
    finish: dict[int, str | None] = field(default_factory=dict)
    stop_reasons: dict[int, int | str | None] = field(default_factory=dict)
    """The stop string or token id that ended each completion (vLLM's `stop_reason`)."""
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
    tool_streams: dict[int, ToolCallStream] = field(default_factory=dict)
    """Per completion, its tool calls read as they stream (chat with tools)."""

    def text(self, index: int) -> str:
        """Completion `index`'s whole text so far."""
        pieces = self.texts.get(index)
        if not pieces:
            return ""
        if len(pieces) > 1:
            pieces[:] = ["".join(pieces)]
        return pieces[0]


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
    tool_parser: ToolParser | None = None
    """Chat with tools (tool_choice not `none`): the output is read for tool calls."""
    reasoning: ChatReasoning | None = None
    """Chat with `--reasoning-parser`: the answer split into reasoning and content."""
    constraint: str | None = None
    """The field the request's constraint came from (what its grammar's failure names)."""

    # -- accumulating -------------------------------------------------------------

    def add(self, output: RequestOutput) -> list[tuple[int, CompletionOutput]]:
        """Count one output in; its completions with their choice index."""
        part = self.parts[output.request_id]
        part.prompt_tokens = len(output.prompt_token_ids)
        part.cached_tokens = output.num_cached_tokens
        indexed = []
        for c in output.outputs:
            part.generated += len(c.token_ids)
            part.texts.setdefault(c.index, []).append(c.text)
            part.finish[c.index] = c.finish_reason or part.finish.get(c.index)
            if c.finish_reason is not None:
                part.stop_reasons[c.index] = c.stop_reason
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

    def chat_choices(self) -> list[ChatChoice]:
        """Chat's choices, whole: content, tool calls (read by the tool parser), finish."""
        choices = []
        for part in self.parts.values():
            for j in range(self.n):
                text = part.text(j)
                finish = part.finish.get(j)
                reasoning = None
                if self.reasoning is not None:  # the thinking first; the rest is the answer
                    split = self.reasoning.parser.split(text)
                    text, reasoning = split.content, split.reasoning or None
                parsed = ParsedOutput(part.echo + text)
                if self.tool_parser is not None:
                    parsed = self.tool_parser.parse(text)
                    if part.echo:
                        parsed.content = part.echo + (parsed.content or "")
                if parsed.content == "" and self.reasoning is not None:
                    parsed.content = None  # as vLLM answers a reasoning model's empty content
                if parsed.tool_calls and finish == "stop":
                    finish = "tool_calls"
                steps = part.steps.get(j, [])
                logprobs = self._logprobs(part, j, part.token_ids.get(j, []), steps)
                index = part.index * self.n + j
                stop = part.stop_reasons.get(j)
                choices.append(
                    ChatChoice(
                        index,
                        parsed.content,
                        parsed.tool_calls,
                        finish,
                        logprobs,
                        stop,
                        reasoning,
                        reasons=self.reasoning is not None,
                    )
                )
        return choices

    def body(self) -> dict[str, Any]:
        if self.chat:
            choices = [choice.as_openai() for choice in self.chat_choices()]
        else:
            choices = [
                {
                    "index": part.index * self.n + j,
                    "finish_reason": part.finish.get(j),
                    "stop_reason": part.stop_reasons.get(j),
                    "logprobs": self._logprobs(
                        part, j, part.token_ids.get(j, []), part.steps.get(j, [])
                    ),
                    "text": part.echo + part.text(j),
                }
                for part in self.parts.values()
                for j in range(self.n)
            ]
        return {
            "id": self.request_id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
        }

    # -- the answer, streamed -------------------------------------------------------

    def chunk(
        self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None
    ) -> dict[str, Any]:
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
        return body

    def first_chunk(self) -> dict[str, Any] | None:
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

    def delta_chunk(self, output: RequestOutput) -> dict[str, Any] | None:
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
            finish = c.finish_reason
            if self.chat and (self.tool_parser is not None or self.reasoning is not None):
                echo = text[: len(text) - len(c.text)]
                choice["delta"], finish = self._chat_delta(part, c, index, echo)
            elif self.chat:
                choice["delta"] = {"content": text} if text else {}
            else:
                choice["text"] = text
            choice["finish_reason"] = finish
            if finish is not None:
                choice["stop_reason"] = c.stop_reason
            choices.append(choice)
        return self.chunk(choices) if choices else None

    def _chat_delta(
        self, part: Part, c: CompletionOutput, index: int, echo: str
    ) -> tuple[dict[str, Any], str | None]:
        """A chat delta read by the reasoning parser (thinking apart), then for tool calls
        (content before the calls, call pieces, finish_reason "tool_calls" once the model
        called and stopped); `echo` goes first as content, read by neither."""
        final = c.finish_reason is not None
        content, delta = c.text, dict[str, Any]()
        if self.reasoning is not None:
            split = self.reasoning.delta(index, c.text, final)
            if "reasoning_content" in split:
                delta["reasoning_content"] = split["reasoning_content"]
            content = split.get("content", "")
        finish = c.finish_reason
        if self.tool_parser is not None:
            stream = part.tool_streams.setdefault(c.index, ToolCallStream(self.tool_parser))
            piece = stream.feed(content)
            if final:
                piece.content += stream.finish().content
            content = piece.content
            if piece.calls:
                delta["tool_calls"] = [call.as_openai() for call in piece.calls]
            if finish == "stop" and stream.called:
                finish = "tool_calls"
        if echo or content:
            delta["content"] = echo + content
        return delta, finish

    def abort_chunk(self) -> dict[str, Any]:
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
