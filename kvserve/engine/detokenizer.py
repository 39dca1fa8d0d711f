"""Incremental detokenization: the text of each new token, O(new tokens) per step.

A token's text depends on its neighbours: byte-level BPE splits one UTF-8
character over several tokens, and SentencePiece decoders drop the leading
space at the start of a decode. So a token is never decoded alone, and the
whole output is never decoded again each step (quadratic). Hugging Face's
`DecodeStream` and vLLM's incremental detokenizer keep a small window instead:

    ids[:read]   context: tokens whose text is already out; `prefix` is their text
    ids[read:]   pending: tokens whose text is not out yet

Each new token is appended and only the window is decoded. If the result is
longer than `prefix` and does not end in U+FFFD (an incomplete UTF-8 sequence
that the next token may complete: "wait"), what follows `prefix` is the new
text, and the pending tokens become the context of the next step. The window
holds the last emitted tokens plus the pending ones, a few tokens, so a step
costs a decode of a few ids however long the output is.

The first window's context is a short suffix of the prompt (as vLLM primes
its stream), so the first output token keeps a leading space a decode of the
output alone would drop. A suffix whose text has a U+FFFD is no context.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

REPLACEMENT = "\ufffd"
"""What a decoder writes for bytes that are not (yet) valid UTF-8."""

Decode = Callable[[list[int]], str]


def decoder_for(tokenizer: Any, skip_special_tokens: bool) -> Decode:
    """`ids -> text` for a window. A fast tokenizer decodes in its Rust backend
    (a few times cheaper than the transformers wrapper around it); neither
    cleans up tokenization spaces, which is not incremental (vLLM does not)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return partial(backend.decode, skip_special_tokens=skip_special_tokens)
    if hasattr(tokenizer, "clean_up_tokenization_spaces"):
        return partial(
            tokenizer.decode,
            skip_special_tokens=skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )
    return partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)


def skipped_ids(tokenizer: Any) -> frozenset[int]:
    """Ids whose text `skip_special_tokens` drops. A detokenizer leaves them out of
    its window, which is exact (the decoder drops them too) and keeps a run of
    them (a model repeating EOS under ignore_eos) from growing the window."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    added = getattr(backend, "get_added_tokens_decoder", None)
    if added is not None:  # tokenizers: skips the added tokens marked special
        return frozenset(i for i, token in added().items() if token.special)
    return frozenset(getattr(tokenizer, "all_special_ids", ()))


def prompt_context(decode: Decode, prompt: Sequence[int]) -> list[int]:
    """The shortest suffix of 4 to 24 prompt tokens (fewer if the prompt is
    shorter) whose text is clean, or [] (vLLM's search for a safe start)."""
    n = len(prompt)
    for length in range(min(4, n), min(n, 24) + 1):
        suffix = list(prompt[n - length :])
        if REPLACEMENT not in decode(suffix):
            return suffix
    return []


@dataclass(slots=True)
class IncrementalDetokenizer:
    """One sequence's window: `ids[:read]` decoded to `prefix`, then pending ids."""

    decode: Decode
    ids: list[int] = field(default_factory=list)
    prefix: str = ""
    read: int = 0
    skipped: frozenset[int] = frozenset()
    """Ids without text (skipped special tokens): never put in the window."""

    @classmethod
    def after(
        cls, decode: Decode, prompt: Sequence[int], skipped: frozenset[int] = frozenset()
    ) -> IncrementalDetokenizer:
        """A detokenizer for the tokens that follow `prompt`."""
        context = prompt_context(decode, prompt)
        return cls(decode, context, decode(context) if context else "", len(context), skipped)

    def step(self, token: int) -> str:
        """The text that `token` completes ("" while it waits)."""
        if token in self.skipped:
            return ""
        ids = self.ids
        ids.append(token)
        text = self.decode(ids)
        prefix = self.prefix
        if len(text) <= len(prefix) or text[-1] == REPLACEMENT:
            return ""
        if not text.startswith(prefix):
            return self._restart()
        del ids[: self.read]  # the pending tokens become the context
        self.read = len(ids)
        self.prefix = self.decode(ids)
        return text[len(prefix) :]

    def flush(self) -> str:
        """At the end: the pending text even if it ends in U+FFFD (nothing will follow)."""
        ids, prefix = self.ids, self.prefix
        if self.read == len(ids):
            return ""
        text = self.decode(ids)
        if not text.startswith(prefix):
            text, prefix = self.decode(ids[self.read :]), ""
        ids.clear()
        self.read, self.prefix = 0, ""
        return text[len(prefix) :]

    def _restart(self) -> str:
        """The context changed text it had already given (a decoder that is not
        monotonic on invalid UTF-8, vLLM #17448): go on without the context."""
        del self.ids[: self.read]
        self.read, self.prefix = 0, ""
        text = self.decode(self.ids)
        if not text or text[-1] == REPLACEMENT:
            return ""
        self.read, self.prefix = len(self.ids), text
        return text


@dataclass(slots=True)
class OutputText:
    """A sequence's output text, grown token by token, and what has been shown of it.

    The text is kept as pieces (one per step that added any): a step appends
    one, a stop-string search reads only the tail, and only a caller that asks
    for the whole text (CUMULATIVE outputs, the end) joins them. `holdback`
    characters at the end are not shown before the sequence finishes: a stop
    string that a later token completes may start inside them, and text once
    shown is never taken back.
    """

    detokenizer: IncrementalDetokenizer
    reach: int = 0
    """Characters before the newest text a new stop-string match may start in:
    the longest stop string's length - 1 (0 without stop strings)."""
    holdback: int = 0
    """`reach` when matched stop strings are cut from the text, else 0."""
    pieces: list[str] = field(default_factory=list)
    length: int = 0
    sent: int = 0
    """Characters already handed out as DELTA text."""

    def add(self, token: int) -> int:
        """Detokenize `token`; the number of characters it added."""
        return self._append(self.detokenizer.step(token))

    def flush(self) -> int:
        """The pending text at the end; the number of characters it added."""
        return self._append(self.detokenizer.flush())

    def _append(self, new: str) -> int:
        if new:
            self.pieces.append(new)
            self.length += len(new)
        return len(new)

    def tail(self, n: int) -> str:
        """The last `n` characters (fewer if the text is shorter), from the last pieces."""
        pieces = self.pieces
        parts: list[str] = []
        got = 0
        i = len(pieces)
        while got < n and i:
            i -= 1
            parts.append(pieces[i])
            got += len(pieces[i])
        joined = "".join(reversed(parts))
        return joined[got - n :] if got > n else joined

    def cut(self, drop: int) -> None:
        """Remove the last `drop` characters (a stop string and what followed it)."""
        if drop > 0:
            whole = "".join(self.pieces)
            self.length -= drop
            self.pieces = [whole[: self.length]]

    def text(self, finished: bool) -> str:
        """All the text so far that may be shown (everything once finished)."""
        pieces = self.pieces
        if len(pieces) > 1:
            pieces[:] = ["".join(pieces)]
        whole = pieces[0] if pieces else ""
        end = self.length if finished else self.length - self.holdback
        return whole if end >= self.length else whole[: max(0, end)]

    def delta(self, finished: bool) -> str:
        """What may be shown and was not handed out yet (then counts as handed out)."""
        end = self.length if finished else self.length - self.holdback
        if end <= self.sent:
            return ""
        new = self.tail(self.length - self.sent)[: end - self.sent]
        self.sent = end
        return new
