"""What every tool-call parser shares: calls are JSON objects `{"name": ..., KEY: {...}}`.

A family's parser says where its calls start and how each is wrapped
(`split`), which key holds the arguments, and what one call looks like as a
grammar (`call_tag`, in the same format, so what a grammar forces the parser
reads back). The rest is here: whole outputs read into a ParsedOutput, and a
call's name and arguments read out of a partial text while it streams.

Written by hand: the streamed arguments are fragments of the model's own JSON
text, and where a partial JSON value ends is not something a JSON library
answers (`json.JSONDecoder.raw_decode` reads only complete values).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from kvserve.structured.tags import COMPACT_WHITESPACE, Format, json_schema, tag
from kvserve.tool_calls.types import ParsedOutput, ToolCall

_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(\w+)"\s*:\s*')


@dataclass(slots=True)
class RawCall:
    """One call's text as written so far: its JSON object from the `{` on."""

    text: str
    complete: bool
    """Its wrapper closed (or its object ended): nothing more of it will come."""


@dataclass(slots=True)
class PartialCall:
    """What a partial call's text says so far."""

    name: str | None
    """The function's name, once its string is closed."""
    arguments: str
    """The arguments' JSON text so far (all of it once `done`)."""
    done: bool


class ToolParser:
    """The base of a family's parser; a subclass sets the class attributes and `split`."""

    name: ClassVar[str]
    """Its name for --tool-call-parser (vLLM's)."""
    trigger: ClassVar[str]
    """The text that starts calls: `auto`'s grammar is free until it appears."""
    separator: ClassVar[str]
    """Between two calls a grammar forces."""
    arguments_key: ClassVar[str]
    """The key of a call's object that holds its arguments."""
    call_end: ClassVar[str] = "}"
    """What closes a call after its arguments (the object's brace, and a wrapper's end)."""
    call_begin: ClassVar[str] = ""
    """What opens a call before its object (a wrapper's start)."""

    def split(self, text: str, scans: list[JsonScan] | None = None) -> tuple[str, list[RawCall]]:
        """The text before the first call, and the calls (the last may be unfinished).
        `scans`: a stream's readings of its calls' objects so far, for a format whose
        calls end where their JSON ends (read on, not again, as the text grows)."""
        raise NotImplementedError

    def held_back(self, content: str) -> int:
        """How many characters at the end of `content` (no call found in it) might be the
        start of the trigger, so a stream holds them until the next delta says."""
        for size in range(min(len(self.trigger) - 1, len(content)), 0, -1):
            if self.trigger.startswith(content[-size:]):
                return size
        return 0

    def call_tag(self, function: str, parameters: dict[str, Any] | bool) -> Format:
        """The grammar of one call of `function`, in this format."""
        begin = f'{self.call_begin}{{"name": {json.dumps(function)}, "{self.arguments_key}": '
        return tag(begin, json_schema(parameters, COMPACT_WHITESPACE), self.call_end)

    def parse(self, text: str) -> ParsedOutput:
        """A whole output: its content and calls. A last call cut short (max_tokens, the
        grammar forcing the rest) is dropped: the calls before it are whole, and the
        finish reason says the answer was cut. Output whose calls do not read as calls
        (not JSON) is all content, as the model wrote it."""
        content, raws = self.split(text)
        if raws and not raws[-1].complete:
            raws = raws[:-1]
            if not raws:
                return ParsedOutput(content if content.strip() else None)
        if not raws:
            return ParsedOutput(text or None)
        calls = []
        for raw in raws:
            call = self._call(raw)
            if call is None:
                return ParsedOutput(text or None)
            calls.append(call)
        return ParsedOutput(content if content.strip() else None, calls)

    def _call(self, raw: RawCall) -> ToolCall | None:
        if not raw.complete:
            return None
        try:
            value = json.loads(raw.text)
        except (json.JSONDecodeError, RecursionError):  # nested past Python's stack: text
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get(self.arguments_key, value.get("arguments", {}))
        if not isinstance(arguments, dict):
            return None
        return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))

    @staticmethod
    def partial(raw: RawCall, scan: JsonScan | None = None) -> PartialCall:
        """A call's name and arguments so far (None / "" until they appear); `scan`: the
        stream's reading of this call's arguments so far (kept by the caller)."""
        match = _NAME.match(raw.text)
        if match is None:
            return PartialCall(None, "", False)
        name = json.loads(f'"{match.group(1)}"')
        start = match.end()
        if start >= len(raw.text):
            return PartialCall(name, "", False)
        end = json_value_end(raw.text, start, scan)
        if end is None:
            return PartialCall(name, raw.text[start:].rstrip(), False)
        return PartialCall(name, raw.text[start:end], True)


def json_value_end(text: str, start: int, scan: JsonScan | None = None) -> int | None:
    """Just past the JSON object or array that opens at `text[start]`; None while it is
    still open (strings and escapes followed, so a brace inside a string is text).
    `scan`: a stream's reading of the same value in an earlier, shorter text, resumed
    where it stopped (each character is read once over the whole stream)."""
    if scan is None:
        scan = JsonScan()
    return scan.end_in(text, start)


@dataclass(slots=True)
class JsonScan:
    """The reading of one JSON value as its text grows (a streamed call's arguments):
    where it got to and in what state, so the next, longer text is read from there."""

    start: int = -1
    seen: str = ""
    """The text read so far (text[:pos]); a text that does not begin with it is read anew."""
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    end: int | None = None
    reads: int = 0
    """Characters read over the scan's life: the stream's cost (linear in its text)."""

    def end_in(self, text: str, start: int) -> int | None:
        """`json_value_end(text, start)`, reading only what this scan has not read yet."""
        if start != self.start or not text.startswith(self.seen):
            self.start, self.seen, self.end = start, "", None
            self.depth, self.in_string, self.escaped = 0, False, False
        if self.end is not None:
            return self.end
        depth, in_string, escaped = self.depth, self.in_string, self.escaped
        first = max(start, len(self.seen))
        for i in range(first, len(text)):
            c = text[i]
            if in_string:
                if escaped:
                    escaped = False
                elif c == "\\":
                    escaped = True
                elif c == '"':
                    in_string = False
            elif c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth <= 0:
                    self.end = i + 1
                    break
        stop = len(text) if self.end is None else self.end
        self.reads += max(0, stop - first)
        self.seen = text[:stop]
        self.depth, self.in_string, self.escaped = depth, in_string, escaped
        return self.end


def json_objects(
    text: str, start: int, separators: str, scans: list[JsonScan] | None = None
) -> list[RawCall]:
    """The JSON objects from `start` on, with only whitespace and `separators` between
    them; the scan stops at anything else (the last object may be unfinished). `scans`:
    the readings of the objects in an earlier, shorter text (one per object, added here)."""
    calls: list[RawCall] = []
    i = start
    while i < len(text):
        c = text[i]
        if c.isspace() or c in separators:
            i += 1
            continue
        if c != "{":
            break
        if scans is not None and len(scans) == len(calls):
            scans.append(JsonScan())
        end = json_value_end(text, i, None if scans is None else scans[len(calls)])
        calls.append(RawCall(text[i : end or len(text)], end is not None))
        if end is None:
            break
        i = end
    return calls
