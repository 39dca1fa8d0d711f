"""The tool-call parsers by name, and the one a checkpoint's chat template implies."""

from __future__ import annotations

from kvserve.tool_calls.hermes import START, HermesParser
from kvserve.tool_calls.llama3_json import PYTHON_TAG, Llama3JsonParser
from kvserve.tool_calls.parser import ToolParser

PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser)}
DEFAULT = HermesParser.name
"""For a template that shows no family's markers (it may render no tools at all): a
forced call still comes out in this format, and is read back in it."""


def parser_named(name: str) -> ToolParser:
    """The parser called `name`; ValueError listing the names there are."""
    if name not in PARSERS:
        raise ValueError(f"no tool-call parser {name!r}; there are {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()


def detect(chat_template: str | None) -> str | None:
    """The parser a chat template's own markers name (None: it shows none)."""
    if not chat_template:
        return None
    if START in chat_template:
        return HermesParser.name
    if PYTHON_TAG in chat_template or '"parameters": ' in chat_template:
        return Llama3JsonParser.name
    return None


def parser_for(name: str | None, chat_template: str | None) -> ToolParser:
    """`name` if given, else the template's family, else DEFAULT."""
    return parser_named(name or detect(chat_template) or DEFAULT)
