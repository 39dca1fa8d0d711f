"""Which request fields are served, refused or ignored: one table, one rule.

/v1/completions and /v1/chat/completions read the fields kvserve implements
(protocol.COMPLETION_FIELDS, protocol.CHAT_FIELDS). Every other field is one
of two kinds:

- Defined by OpenAI's or vLLM's API, would change the answer, and not
  implemented here (the tables below): a 400 naming it, unless its value is
  neutral, one that asks for nothing (null always, and each entry's own
  values: `functions: []`, `add_generation_prompt: true`, ...). A neutral value is
  accepted silently, so a client or router that sends a default still works;
  anything else would be answered as if the field were not there, which is
  the wrong answer, not an ignored detail.
- Anything else: ignored, as vLLM's server ignores an unknown field. The
  answer says so (`x-kvserve-ignored-fields`), and the server logs one
  warning per distinct name, not per request: a router that adds the same
  fields to every body must not flood the log.

vllm-router 0.1.17 re-serializes every body from its own request type and
adds these (seen on the wire): completions, served `echo: false`,
`ignore_eos: false`, `skip_special_tokens: true`, neutral `no_stop_trim:
false` (SGLang's; true would keep a matched stop string), and ignored
`return_hidden_states: false`; chat, served `logprobs: false`,
`ignore_eos: false`, `skip_special_tokens: true`, neutral
`continue_final_message: false` and `no_stop_trim: false`, and ignored
`return_hidden_states: false`, `separate_reasoning: true`,
`stream_reasoning: true`, `include_reasoning: true`. The client's own fields
it passes on, unknown ones included (numbers may come as floats: `0.0`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from kvserve.serve.http.errors import APIError

log = logging.getLogger("kvserve.serve")
HEADER = "x-kvserve-ignored-fields"
MAX_LISTED = 32
"""Names in the header; past them one `+N` says how many more were ignored."""
MAX_NAME = 64
"""Characters of a name shown (header and log); a longer one is cut, ending in `...`."""
MAX_HEADER = 2048
"""The header's length at most: names past it are counted in the `+N`."""
MAX_LOGGED = 64
"""Distinct names warned about per server: a client inventing names cannot fill the log."""


@dataclass(frozen=True, slots=True)
class Unsupported:
    """A field kvserve does not implement, and the values of it that ask for nothing."""

    what: str
    """What kvserve does not do, for the error message."""
    neutral: tuple[Any, ...] = ()
    """Besides null. Compared strictly: `false` is not `0`, `1.0` is `1`."""
    neutral_if: Callable[[Any, dict[str, Any]], bool] | None = None
    """Neutral given the rest of the body (`best_of` equal to `n`)."""

    def is_neutral(self, value: Any, body: dict[str, Any]) -> bool:
        if value is None or any(_same(value, n) for n in self.neutral):
            return True
        return self.neutral_if is not None and self.neutral_if(value, body)


def _same(a: Any, b: Any) -> bool:
    """Equal as JSON values: a bool equals only a bool (Python has True == 1)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)  # numbers compare by value; other kinds are never equal


def _unless_set(other: str) -> Callable[[Any, dict[str, Any]], bool]:
    """`auto` asks for nothing while `other` (the tools) is absent or empty."""
    return lambda value, body: value == "auto" and not body.get(other)


_BEAM = "beam search"
COMMON: dict[str, Unsupported] = {
    "structural_tag": Unsupported("structural tags"),
    "best_of": Unsupported("best_of", (1,), lambda v, body: _same(v, body.get("n") or 1)),
    "use_beam_search": Unsupported(_BEAM, (False,)),
    "length_penalty": Unsupported(_BEAM, (1.0,)),
    "prompt_logprobs": Unsupported("prompt logprobs"),
    "allowed_token_ids": Unsupported("allowed_token_ids"),
    "bad_words": Unsupported("bad_words", ([],)),
    "truncate_prompt_tokens": Unsupported("prompt truncation"),
    "spaces_between_special_tokens": Unsupported("spaces_between_special_tokens", (True,)),
    "return_tokens_as_token_ids": Unsupported("tokens as token ids", (False,)),
    "logits_processors": Unsupported("custom logits processors", ([],)),
    "no_stop_trim": Unsupported("no_stop_trim (a matched stop string is always cut)", (False,)),
}
"""Both endpoints. Served fields (ignore_eos, min_tokens, stop_token_ids, response_format,
structured_outputs and guided_*: structured.py; chat's tools: tools.py, ...) are not here."""
COMPLETION_ONLY: dict[str, Unsupported] = {
    "suffix": Unsupported("suffix (fill in the middle)", ("",)),
    "prompt_embeds": Unsupported("prompt embeddings"),
    "add_special_tokens": Unsupported("add_special_tokens (always true)", (True,)),
}
CHAT_ONLY: dict[str, Unsupported] = {
    "functions": Unsupported("function calling", ([],)),
    "function_call": Unsupported("function calling", ("none",), _unless_set("functions")),
    "add_generation_prompt": Unsupported("add_generation_prompt (always true)", (True,)),
    "continue_final_message": Unsupported("continue_final_message", (False,)),
    "add_special_tokens": Unsupported("add_special_tokens (always false in chat)", (False,)),
    "chat_template": Unsupported("a chat template per request"),
    "documents": Unsupported("documents", ([],)),
    "audio": Unsupported("audio output"),
    "modalities": Unsupported("audio output", (["text"],)),
}
UNSUPPORTED = {False: {**COMMON, **COMPLETION_ONLY}, True: {**COMMON, **CHAT_ONLY}}
"""By endpoint (chat or not): every field refused unless neutral, with its neutral values."""


def ignored_fields(body: dict[str, Any], served: frozenset[str], chat: bool) -> list[str]:
    """The body's fields kvserve ignores; a 400 for an unsupported one that asks for something."""
    table = UNSUPPORTED[chat]
    ignored = []
    for name, value in body.items():
        if name in served:
            continue
        entry = table.get(name)
        if entry is None:
            ignored.append(name)
        elif not entry.is_neutral(value, body):
            raise _refusal(name, entry)
    return ignored


def _refusal(name: str, entry: Unsupported) -> APIError:
    allowed = ", ".join(json.dumps(v) for v in (None, *entry.neutral))
    return APIError(
        f"unsupported field {name!r}: kvserve does not implement {entry.what} "
        f"(accepted only as {allowed})",
        param=name,
    )


def strict_fields(
    body: dict[str, Any],
    served: frozenset[str],
    ignorable: frozenset[str],
    refused: dict[str, Unsupported],
) -> list[str]:
    """The Responses and Messages APIs' rule, stricter than chat's: a field is served,
    ignorable (documented, changes nothing in the answer: `metadata`, `user`, ...; returned,
    for the header), or refused unless neutral; any other is a 400 naming it, as OpenAI's
    and Anthropic's own servers answer an unknown field."""
    ignored = []
    for name, value in body.items():
        if name in served:
            continue
        if name in ignorable:
            ignored.append(name)
            continue
        entry = refused.get(name)
        if entry is None:
            raise APIError(f"unknown field {name!r}"[:200], param=name)
        if not entry.is_neutral(value, body):
            raise _refusal(name, entry)
    return ignored


def header(names: list[str]) -> dict[str, str]:
    """`x-kvserve-ignored-fields: a,b` (names percent-encoded), or no header for none."""
    if not names:
        return {}
    listed: list[str] = []
    size = 0
    for name in names[:MAX_LISTED]:
        shown = quote(name if len(name) <= MAX_NAME else name[: MAX_NAME - 3] + "...", safe="")
        if size + len(shown) + 1 > MAX_HEADER:
            break
        listed.append(shown)
        size += len(shown) + 1
    if len(names) > len(listed):
        listed.append(f"+{len(names) - len(listed)}")
    return {HEADER: ",".join(listed)}


@dataclass(slots=True)
class IgnoredLog:
    """The names warned about so far (event-loop owned): each once, at most MAX_LOGGED."""

    logged: set[str] = field(default_factory=set)

    def note(self, names: Iterable[str]) -> None:
        room = MAX_LOGGED - len(self.logged)
        new = [n for n in dict.fromkeys(names) if n not in self.logged][: max(room, 0)]
        if not new:
            return
        self.logged.update(new)
        shown = ", ".join(repr(n if len(n) <= 64 else n[:64] + "...") for n in new)
        log.warning("ignoring request field(s) kvserve does not know: %s", shown)
        if len(self.logged) == MAX_LOGGED:
            log.warning("%d distinct ignored fields logged; no more will be", MAX_LOGGED)
