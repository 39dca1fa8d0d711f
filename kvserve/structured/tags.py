"""Structural tags as plain data: free text, tags, triggers and schemas composed.

xgrammar's structural tag (its JSON form, `{"type": "structural_tag", "format":
...}`) composes grammars: a tag is `begin content end`; triggered tags allow
free text until a trigger (a prefix of some tag's `begin`) appears, then hold
the output to that tag until its end (llama.cpp's lazy grammar, in xgrammar's
own terms); tags with a separator allow calls and nothing else. The engine
compiles one as any other constraint
(`StructuredOutputsParams(structural_tag=...)`), so composing needs no second
mechanism in the engine.

These builders return the JSON form as dicts (no xgrammar import: the server
builds them on its event loop); xgrammar validates them when the request is
added. Tool calls use them (kvserve.tool_calls); so can any "free text until a
marker, then a grammar" constraint, such as a reasoning block before a schema:
`structural_tag(sequence(tag("<think>", any_text(), "</think>"), json_schema(s)))`.
"""

from __future__ import annotations

import json
from typing import Any

from kvserve.sampling_params import StructuredOutputsParams

Format = dict[str, Any]
COMPACT_WHITESPACE = 2
"""Whitespace characters in a row a JSON format built here allows (`{"a": 1}` needs one):
without a bound a model, a small or random one above all, may pad until its token limit."""


def json_schema(schema: dict[str, Any] | bool, max_whitespace: int | None = None) -> Format:
    """Text that is one JSON value matching `schema` (True: any JSON value);
    `max_whitespace`: the most whitespace characters in a row (None: any run; a random
    model may otherwise write spaces until its token limit)."""
    format: Format = {"type": "json_schema", "json_schema": schema}
    if max_whitespace is not None:
        format["max_whitespace_cnt"] = max_whitespace
    return format


def any_text(excludes: list[str] | None = None) -> Format:
    """Any text (never containing one of `excludes`)."""
    return {"type": "any_text", "excludes": list(excludes or [])}


def const(text: str) -> Format:
    """Exactly `text`."""
    return {"type": "const_string", "value": text}


def one_of(*formats: Format) -> Format:
    """Exactly one of the formats."""
    return {"type": "or", "elements": list(formats)}


def as_format(spec: StructuredOutputsParams) -> Format:
    """A request's constraint as a format, to compose it with others (the answer a
    tool-calling request gives when it calls nothing, a schema after a reasoning block).
    ValueError when a JSON schema given as text is not JSON."""
    kind, text = spec.key
    if kind in ("json", "json_object"):
        try:
            schema = json.loads(text) if kind == "json" else {"type": "object"}
        except json.JSONDecodeError as exc:
            raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
        return json_schema(schema, COMPACT_WHITESPACE)
    if kind == "regex":
        return {"type": "regex", "pattern": text}
    if kind == "choice":
        return one_of(*(const(choice) for choice in json.loads(text)))
    if kind == "structural_tag":
        return dict(json.loads(text)["format"])
    return {"type": "grammar", "grammar": text}


def tag(begin: str, content: Format, end: str) -> Format:
    """`begin`, then text of the `content` format, then `end`."""
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def sequence(*formats: Format) -> Format:
    """Each format in turn."""
    return {"type": "sequence", "elements": list(formats)}


def free_text_then_tags(
    triggers: list[str],
    tags: list[Format],
    at_least_one: bool = False,
    stop_after_first: bool = False,
    excludes: list[str] | None = None,
) -> Format:
    """Free text until a trigger, then the tag it starts (each tag's `begin` starts with
    one trigger); free text again after its end. `stop_after_first`: the output ends
    with the first tag; `at_least_one`: a tag must come."""
    return {
        "type": "triggered_tags",
        "triggers": list(triggers),
        "tags": list(tags),
        "at_least_one": at_least_one,
        "stop_after_first": stop_after_first,
        "excludes": list(excludes or []),
    }


def tags_only(
    tags: list[Format], separator: str, at_least_one: bool = True, stop_after_first: bool = False
) -> Format:
    """One or more tags (zero unless `at_least_one`) with `separator` between them and no
    other text; `stop_after_first`: exactly one."""
    return {
        "type": "tags_with_separator",
        "tags": list(tags),
        "separator": separator,
        "at_least_one": at_least_one,
        "stop_after_first": stop_after_first,
    }


def structural_tag(format: Format) -> str:
    """The structural tag's JSON text (what StructuredOutputsParams.structural_tag takes;
    the same tag gives the same text, so its compile is cached)."""
    return json.dumps({"type": "structural_tag", "format": format}, sort_keys=True)
