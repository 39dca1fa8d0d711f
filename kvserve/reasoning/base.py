"""The `<think>…</think>` split that Qwen3 and DeepSeek-R1 share, whole and streamed.

Written by hand: the split is a few string searches, and what matters is the
streamed case, where a marker may arrive cut over several deltas. The stream
holds back only a tail that could still become the marker, and lets
everything else through at once, so the reasoning and content deltas add up
to exactly what `split` gives for the whole text, and no marker ever leaks
into either.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ReasoningSplit:
    """What one piece of output holds: reasoning text and content text (either may be "")."""

    reasoning: str = ""
    content: str = ""


class ThinkParser:
    """A model that reasons between `start` and `end` markers before it answers.

    `starts_in_reasoning`: the chat template already put `start` in the prompt
    (DeepSeek-R1), so the output begins inside the reasoning and a leading
    `start` is only tolerated. Otherwise the output reasons only when it opens
    with `start` (Qwen3); without it, everything is content. Reasoning that
    never ends (the answer cut by max_tokens) is all reasoning.
    """

    start = "<think>"
    end = "</think>"
    starts_in_reasoning = False
    thinking_switch: str | None = "enable_thinking"
    """The chat_template_kwargs key that turns thinking off (False: no reasoning at all);
    None: the template has no such switch."""

    def __init__(self, template_kwargs: dict[str, object] | None = None) -> None:
        """`template_kwargs`: the request's chat_template_kwargs; `{switch: False}` makes the
        whole answer content (the template then writes an empty think block itself)."""
        switch = self.thinking_switch
        self.thinking = switch is None or (template_kwargs or {}).get(switch) is not False

    def split(self, text: str) -> ReasoningSplit:
        """The whole output, split."""
        stream = self.stream()
        first = stream.feed(text)
        last = stream.finish()
        return ReasoningSplit(first.reasoning + last.reasoning, first.content + last.content)

    def stream(self) -> ReasoningStream:
        """A fresh state for one streamed completion."""
        mode = "content"
        if self.thinking:
            mode = "reasoning" if self.starts_in_reasoning else "opening"
        return ReasoningStream(self.start, self.end, mode)


@dataclass(slots=True)
class ReasoningStream:
    """One completion's streamed split: `feed` each text delta, `finish` at the end."""

    start: str
    end: str
    mode: str
    """"opening" (before the output shows whether it opens with `start`; a leading `start`
    is also skipped in "reasoning" until `seen_text`), "reasoning" or "content"."""
    held: str = ""
    """A tail that may still become a marker: sent once it cannot."""
    seen_text: bool = field(default=False)

    def feed(self, delta: str) -> ReasoningSplit:
        text = self.held + delta
        self.held = ""
        out = ReasoningSplit()
        if self.mode == "opening":
            if self.start.startswith(text):  # "<th": may still be the opening marker
                self.held = text
                return out
            if text.startswith(self.start):
                text = text[len(self.start) :]
                self.mode = "reasoning"
                self.seen_text = True
            else:
                self.mode = "content"
        if self.mode == "reasoning" and not self.seen_text:  # DeepSeek-R1 may repeat <think>
            if self.start.startswith(text):
                self.held = text
                return out
            text = text.removeprefix(self.start)
            self.seen_text = True
        if self.mode == "reasoning":
            before, found, after = text.partition(self.end)
            if found:
                out.reasoning = before
                self.mode = "content"
                text = after
            else:
                keep = _marker_prefix_len(text, self.end)
                out.reasoning = text[: len(text) - keep]
                self.held = text[len(text) - keep :]
                return out
        out.content = text
        return out

    def finish(self) -> ReasoningSplit:
        """What was held back: the output ended, so it is no marker."""
        held, self.held = self.held, ""
        if self.mode == "reasoning":
            return ReasoningSplit(reasoning=held)
        return ReasoningSplit(content=held)


def _marker_prefix_len(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (0: none)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
