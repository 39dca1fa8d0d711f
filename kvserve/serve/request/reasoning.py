"""Chat answers of a reasoning model: `reasoning_content` apart from `content`.

With `--reasoning-parser` (kvserve.reasoning) a chat answer is split where the
model ends its thinking: whole (`message.reasoning_content`, `message.content`;
null when empty, as vLLM answers) or streamed, each choice through its own
stream state (deltas carry `reasoning_content` while the model thinks, then
`content`; a marker cut over two deltas is held until it is whole, and never
sent). With structured outputs the constraint starts once the thinking ends
(kvserve.structured.after_text), unless the request turned thinking off.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from kvserve.reasoning.base import ReasoningSplit, ReasoningStream, ThinkParser
from kvserve.reasoning.registry import reasoning_parser
from kvserve.sampling_params import SamplingParams
from kvserve.serve.http.errors import APIError


@dataclass(slots=True)
class ChatReasoning:
    """One chat request's split: the parser, and each streamed choice's state."""

    parser: ThinkParser
    streams: dict[int, ReasoningStream] = field(default_factory=dict)

    def message(self, text: str, echo: str = "") -> dict[str, Any]:
        """The whole answer as an assistant message; `echo` (the prompt's text, not the
        model's) is content as it is, before the generated text's content."""
        split = self.parser.split(text)
        return {
            "role": "assistant",
            "content": echo + split.content or None,
            "reasoning_content": split.reasoning or None,
        }

    def delta(self, choice: int, text: str, final: bool, echo: str = "") -> dict[str, str]:
        """A streamed choice's next text as a delta (what is held back is not in it);
        `echo` goes first as content, unparsed."""
        stream = self.streams.get(choice)
        if stream is None:
            stream = self.streams[choice] = self.parser.stream()
        out = stream.feed(text)
        if final:
            tail = stream.finish()
            out = ReasoningSplit(out.reasoning + tail.reasoning, out.content + tail.content)
        delta = {}
        if out.reasoning:
            delta["reasoning_content"] = out.reasoning
        if echo or out.content:
            delta["content"] = echo + out.content
        return delta


def chat_reasoning(
    name: str | None, template_kwargs: dict[str, Any], params: SamplingParams, field_name: str
) -> tuple[ChatReasoning | None, SamplingParams]:
    """The request's split (None without a parser) and its params, whose constraint (from
    `field_name`) now starts after the thinking; a 400 naming it if it cannot be built."""
    if name is None:
        return None, params
    parser = reasoning_parser(name, template_kwargs)
    spec = params.structured_outputs
    if spec is not None and parser.thinking:
        from kvserve.structured.after_text import grammar_after_text

        try:
            spec = grammar_after_text(parser.end, spec)
        except ValueError as exc:
            raise APIError(str(exc), param=field_name) from None
        params = replace(params, structured_outputs=spec)
    return ChatReasoning(parser), params
