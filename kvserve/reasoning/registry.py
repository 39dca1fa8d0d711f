"""`--reasoning-parser NAME` -> its parser class (vLLM's names)."""

from __future__ import annotations

from kvserve.reasoning.base import ThinkParser
from kvserve.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from kvserve.reasoning.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ThinkParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
}


def reasoning_parser(name: str, template_kwargs: dict[str, object] | None = None) -> ThinkParser:
    """The parser `name` for one request (its chat_template_kwargs may turn thinking off)."""
    try:
        parser = REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"reasoning parser must be one of {sorted(REASONING_PARSERS)}, got {name!r}"
        ) from None
    return parser(template_kwargs)
