"""One completion's tool calls read delta by delta, as OpenAI streams them.

Each delta of text goes in; out come the content that is surely content (the
text before the first call, less a tail that may be the start of the
trigger, held until the next delta tells), and call pieces: per call, first
its index, id, type and name with arguments "", then fragments of its
arguments' JSON text as the model writes them. The trigger and a call's
wrapper never reach the content. Each delta costs what it adds, however long
the answer grows: the text is searched for markers in C (str.find, re), and
the characters of each call's JSON, the one part read in Python, are read
once over the stream (each call keeps its JsonScan), not again per delta.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.tool_calls.parser import JsonScan, ToolParser
from kvserve.tool_calls.types import ToolCallDelta, new_call_id


@dataclass(slots=True)
class _Sent:
    id: str
    arguments: int = 0
    """Characters of the arguments' text sent so far."""
    scan: JsonScan = field(default_factory=JsonScan)
    """The reading of its arguments so far."""


@dataclass(slots=True)
class StreamPiece:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


class ToolCallStream:
    """The streaming state of one completion (one choice of one request)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self._content_sent = 0
        self._sent: list[_Sent] = []
        self._scans: list[JsonScan] = []
        """The parser's readings of the calls' objects (formats that need them)."""

    @property
    def called(self) -> bool:
        """A call was announced (the choice ends with finish_reason "tool_calls")."""
        return bool(self._sent)

    @property
    def json_reads(self) -> int:
        """Characters of the calls' JSON read so far: each about once over the stream
        (at most twice, with the parser's own reading), however the deltas cut it."""
        return sum(s.reads for s in self._scans) + sum(s.scan.reads for s in self._sent)

    def feed(self, delta: str) -> StreamPiece:
        """What `delta` adds to the stream."""
        self.text += delta
        content, raws = self.parser.split(self.text, self._scans)
        safe = len(content) if raws else len(content) - self.parser.held_back(content)
        piece = StreamPiece(content[self._content_sent : safe] if not self._sent else "")
        self._content_sent = max(self._content_sent, safe)
        for index, raw in enumerate(raws):
            known = index < len(self._sent)
            scan = self._sent[index].scan if known else JsonScan()
            partial = self.parser.partial(raw, scan)
            if partial.name is None:
                break
            if not known:
                self._sent.append(_Sent(new_call_id(), scan=scan))
                piece.calls.append(ToolCallDelta(index, "", self._sent[index].id, partial.name))
            sent = self._sent[index]
            fragment = partial.arguments[sent.arguments :]
            if fragment:
                piece.calls.append(ToolCallDelta(index, fragment))
                sent.arguments = len(partial.arguments)
        return piece

    def finish(self) -> StreamPiece:
        """The end of the output: a tail held back is content after all (no call came); a
        call cut before its name closed is dropped, as `ToolParser.parse` drops it."""
        if self._sent:
            return StreamPiece()
        content, _ = self.parser.split(self.text, self._scans)
        rest = content[self._content_sent :]
        self._content_sent = len(content)
        return StreamPiece(rest)
