"""A request's structured-output fields -> one StructuredOutputsParams (or None).

Three spellings ask for the same thing; a request uses one constraint at most:

- OpenAI's `response_format`: `{"type": "text"}` (no constraint),
  `{"type": "json_object"}`, or `{"type": "json_schema", "json_schema":
  {"name": ..., "schema": {...}, "strict": ...}}`;
- vLLM's `structured_outputs` object: one of `json`, `json_object`, `regex`,
  `choice`, `grammar` (StructuredOutputsParams' own names);
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`,
  `guided_grammar`.

Only the shape is checked here: a malformed one is a 400 naming the field the
client sent (`param`), two constraints a 400 naming both. Whether xgrammar can
compile the schema, regex or grammar is the engine's check when the request
is added (its ValueError becomes a 400 too: generation/submit.py), or, for the rare
grammar that fails only in the compile itself (or past --grammar-compile-timeout),
when the scheduler would admit it, before its prefill (the same 400, the first
output being awaited before any answer starts).
"""

from __future__ import annotations

from typing import Any

from kvserve.request_limits import LimitError, decode_json
from kvserve.sampling_params import CONSTRAINTS, StructuredOutputsParams
from kvserve.serve.http.errors import APIError

GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
"""vLLM's older fields -> the constraint each sets."""
FIELDS = frozenset({"response_format", "structured_outputs", *GUIDED})
"""The request fields read here (served on both endpoints)."""
_ENGINE_PREFIX = "structured_outputs"


def structured_outputs(body: dict[str, Any]) -> tuple[StructuredOutputsParams, str] | None:
    """The request's constraint and the field it came from; None for none; a 400 for a
    malformed one or more than one."""
    found: list[tuple[str, dict[str, Any]]] = []
    response_format = _response_format(body.get("response_format"))
    if response_format is not None:
        found.append(("response_format", response_format))
    vllm = _vllm_object(body.get("structured_outputs"))
    if vllm is not None:
        found.append(("structured_outputs", vllm))
    for name, ours in GUIDED.items():
        value = body.get(name)
        if value is not None:
            found.append((name, {ours: value}))
    if not found:
        return None
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise APIError(
            f"one structured-output constraint per request; got {names}", param=found[1][0]
        )
    name, kwargs = found[0]
    _check_json_shapes(name, kwargs)
    try:
        return StructuredOutputsParams(**kwargs), name
    except (ValueError, TypeError) as exc:
        raise APIError(_as_sent(str(exc), name, kwargs), param=name) from None


def _check_json_shapes(name: str, kwargs: dict[str, Any]) -> None:
    """A schema or structural tag is JSON of the shape its readers take (the size check,
    the tools' composition, the compile): a schema an object or a boolean, a tag an object
    with a `format` object. Text is read as the body is, at most 32 deep. Checked here,
    before anything reads it, so each is a 400 in the client's words, never a 500."""
    for key in ("json", "structural_tag"):
        value = kwargs.get(key)
        if not isinstance(value, str | dict):
            continue  # absent, or a type StructuredOutputsParams names
        where = name if name in GUIDED else f"{name}.{key}"
        if isinstance(value, str):
            try:
                value = decode_json(value, where)
            except LimitError as exc:
                raise APIError(exc.message[:300], param=name) from None
        if key == "json" and not isinstance(value, dict | bool):
            raise APIError(f"{where} must be a JSON schema (an object)", param=name)
        if key == "structural_tag" and not (
            isinstance(value, dict) and isinstance(value.get("format"), dict)
        ):
            raise APIError(
                f"{where} must be an object with a format (an object), as xgrammar's "
                "structural tags are",
                param=name,
            )


def _response_format(value: Any) -> dict[str, Any] | None:
    """OpenAI's `response_format` as StructuredOutputsParams' arguments (None: text)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise APIError("response_format must be an object", param="response_format")
    kind = value.get("type")
    allowed = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
    if kind not in allowed:
        raise APIError(
            f"response_format.type must be 'text', 'json_object' or 'json_schema', "
            f"got {_short(kind)}",
            param="response_format",
        )
    extra = sorted(set(value) - allowed[kind])
    if extra:
        raise APIError(
            f"response_format of type {kind!r} takes no {', '.join(map(repr, extra))}"[:300],
            param="response_format",
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise APIError(
            "response_format.json_schema must be an object with a name and a schema",
            param="response_format",
        )
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise APIError(
            "response_format.json_schema.name must be a non-empty string",
            param="response_format",
        )
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise APIError(
            "response_format.json_schema.strict must be true or false", param="response_format"
        )
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise APIError(
            "response_format.json_schema.schema must be a JSON schema (an object)",
            param="response_format",
        )
    return {"json": schema}


def _vllm_object(value: Any) -> dict[str, Any] | None:
    """vLLM's `structured_outputs` object: its set constraint (nulls dropped)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise APIError("structured_outputs must be an object", param="structured_outputs")
    unknown = sorted(k for k, v in value.items() if k not in CONSTRAINTS and v is not None)
    if unknown:
        shown = ", ".join(repr(k[:64]) for k in unknown[:8])
        raise APIError(
            f"structured_outputs: unsupported key(s) {shown} "
            f"(kvserve reads {', '.join(CONSTRAINTS)})",
            param="structured_outputs",
        )
    set_ = {k: v for k, v in value.items() if v is not None and v is not False}
    if not set_:
        return None  # all null (or json_object: false): asks for nothing
    return set_


def engine_param(message: str, source: str | None) -> str | None:
    """The field to blame for the engine's refusal `message`: the constraint's field
    when the message is about it (the engine names it `structured_outputs...`)."""
    if source is not None and message.startswith(_ENGINE_PREFIX):
        return source
    return None


def _as_sent(message: str, name: str, kwargs: dict[str, Any]) -> str:
    """StructuredOutputsParams' message in the client's words (guided_choice, not
    structured_outputs.choice)."""
    if name in GUIDED:
        return message.replace(f"structured_outputs.{GUIDED[name]}", name)
    if name == "response_format" and "json" in kwargs:
        return message.replace("structured_outputs.json", "response_format.json_schema.schema")
    return message


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def compile_failure(error: str, source: str | None) -> APIError | None:
    """A 400 for a request whose grammar failed in the compile itself (the engine fails
    the request alone, with `error` = `ValueError: structured_outputs: ...`); None for
    any other failure (a 500)."""
    prefix = f"ValueError: {_ENGINE_PREFIX}"
    if source is None or not error.startswith(prefix):
        return None
    return APIError(error.removeprefix("ValueError: "), param=source)
