"""Hermes-style calls, as Qwen2.5, Qwen3 and Hermes models write them.

    some text<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Each call is a JSON object between `<tool_call>` and `</tool_call>`; several
calls follow one another (a newline between); the text before the first is
the message's content.
"""

from __future__ import annotations

from kvserve.tool_calls.parser import JsonScan, RawCall, ToolParser

START = "<tool_call>"
END = "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"
    trigger = START
    separator = "\n"
    arguments_key = "arguments"
    call_begin = f"{START}\n"
    call_end = f"}}\n{END}"

    def split(self, text: str, scans: list[JsonScan] | None = None) -> tuple[str, list[RawCall]]:
        """Calls end at their END marker, found by a string search: `scans` are not needed."""
        first = text.find(START)
        if first < 0:
            return text, []
        calls = []
        at = first
        while at >= 0:
            body_start = at + len(START)
            end = text.find(END, body_start)
            if end < 0:
                calls.append(RawCall(text[body_start:].lstrip(), False))
                break
            calls.append(RawCall(text[body_start:end].strip(), True))
            at = text.find(START, end + len(END))
        return text[:first], calls
