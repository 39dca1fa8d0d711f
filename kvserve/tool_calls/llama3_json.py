"""Llama 3's JSON calls, as Llama 3.1 / 3.2 write them (JSON-based tool calling).

    {"name": "get_weather", "parameters": {"city": "Paris"}}

A call is a JSON object with `name` and `parameters` (`arguments` is read too),
optionally after `<|python_tag|>`; several are separated by `;`. The text
before the first is the message's content.
"""

from __future__ import annotations

import re

from kvserve.tool_calls.parser import JsonScan, RawCall, ToolParser, json_objects

PYTHON_TAG = "<|python_tag|>"
_START = re.compile(r'<\|python_tag\|>|\{\s*"name"\s*:')


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    trigger = '{"name": '
    separator = "; "
    arguments_key = "parameters"

    def split(self, text: str, scans: list[JsonScan] | None = None) -> tuple[str, list[RawCall]]:
        match = _START.search(text)
        if match is None:
            return text, []
        start = match.end() if match.group() == PYTHON_TAG else match.start()
        return text[: match.start()], json_objects(text, start, ";", scans)
