"""Qwen3: the answer opens with `<think>` when the model reasons; `enable_thinking: false`
in chat_template_kwargs makes the template close an empty think block in the prompt, so
the whole answer is content."""

from __future__ import annotations

from kvserve.reasoning.base import ThinkParser


class Qwen3ReasoningParser(ThinkParser):
    starts_in_reasoning = False
