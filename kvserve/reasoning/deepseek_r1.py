"""DeepSeek-R1: its chat template ends the prompt with `<think>\n`, so the answer starts
inside the reasoning (a `<think>` the model writes anyway is dropped) and ends it with
`</think>`; an answer without `</think>` is all reasoning."""

from __future__ import annotations

from kvserve.reasoning.base import ThinkParser


class DeepSeekR1ReasoningParser(ThinkParser):
    starts_in_reasoning = True
    thinking_switch = None
