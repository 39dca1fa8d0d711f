"""A chat request's `tools`, `tool_choice` and `parallel_tool_calls`, checked, and the
grammar that makes the model's calls valid.

- `none` (and no tools): no parsing, no grammar; the template gets no tools.
- `auto`: the model writes freely; from the parser's trigger on, the output is
  held to a call of one of the tools, its arguments matching the tool's schema
  (a lazy grammar: xgrammar's triggered tags).
- `required`: calls only, at least one; a named function: exactly one call of
  it. Both are forced from the first token, so any model, a tiny random one
  too, answers with a valid call.
- `parallel_tool_calls: false`: at most one call.
- Another constraint on the answer (`response_format`, as the Agents SDK sends
  with an `output_type`): with `auto` the output is either calls or an answer
  matching it; forced calls are the whole answer, so it does not apply.

The grammar is written by the parser (`call_tag`), in the format it reads back.
Errors are ValueErrors whose message starts with the field at fault.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kvserve.chat_template import offered_tools
from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured.tags import (
    Format,
    free_text_then_tags,
    one_of,
    structural_tag,
    tags_only,
)
from kvserve.tool_calls.parser import ToolParser

CHOICES = ("none", "auto", "required")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
"""OpenAI's rule for a function's name (dots allowed, as vLLM allows them)."""
_JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


@dataclass(slots=True, frozen=True)
class ToolRequest:
    """What the request asked of tools: the tools (OpenAI's dicts, for the template),
    the choice (`none`, `auto`, `required` or `named`), the named function, and
    whether several calls may come."""

    tools: list[dict[str, Any]]
    choice: str
    named: str | None = None
    parallel: bool = True

    @property
    def parses(self) -> bool:
        """The output is read for calls (every choice but `none`)."""
        return self.choice != "none"

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """What the chat template is given (None with `none`: no tool is offered)."""
        return offered_tools(self.tools, self.choice)

    def constraint(
        self, parser: ToolParser, answer: Format | None = None
    ) -> StructuredOutputsParams | None:
        """The grammar of the allowed outputs, in `parser`'s format (None: `none`);
        `answer`: what a reply without calls must be (`auto` only)."""
        if not self.parses:
            return None
        tags = [
            parser.call_tag(tool["function"]["name"], _schema(tool))
            for tool in self.tools
            if self.named is None or tool["function"]["name"] == self.named
        ]
        if self.choice == "auto" and answer is not None:
            calls = tags_only(tags, parser.separator, stop_after_first=not self.parallel)
            format = one_of(calls, answer)
        elif self.choice == "auto":
            format = free_text_then_tags([parser.trigger], tags, stop_after_first=not self.parallel)
        else:
            single = self.choice == "named" or not self.parallel
            format = tags_only(tags, parser.separator, at_least_one=True, stop_after_first=single)
        return StructuredOutputsParams(structural_tag=structural_tag(format))


def _schema(tool: dict[str, Any]) -> dict[str, Any]:
    """The tool's arguments schema (none given: an object, as OpenAI reads it)."""
    parameters: dict[str, Any] = tool["function"].get("parameters") or {"type": "object"}
    return parameters


def tool_request(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolRequest | None:
    """The request's tool fields checked; None when it offers no tools."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ValueError("parallel_tool_calls must be true or false")
    if tools is None or tools == []:
        if tool_choice is None or tool_choice in ("none", "auto"):
            return None
        raise ValueError(f"tool_choice {_short(tool_choice)} needs tools")
    if not isinstance(tools, list):
        raise ValueError("tools must be a list of {'type': 'function', 'function': {...}}")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        name = _check_tool(tool, i)
        if name in names:
            raise ValueError(f"tools[{i}].function.name {name!r} is given twice")
        names.add(name)
    choice, named = _choice(tool_choice, names)
    return ToolRequest(list(tools), choice, named, parallel_tool_calls is not False)


def _check_tool(tool: Any, i: int) -> str:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ValueError(f"{where} must be {{'type': 'function', 'function': {{...}}}}")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ValueError(f"{where}.function must be an object with a name")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"{where}.function.name must be 1 to 64 letters, digits, '_', '-' or '.', "
            f"got {_short(name)}"
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ValueError(f"{where}.function.description must be a string")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ValueError(f"{where}.function.strict must be true or false")
    parameters = function.get("parameters")
    if parameters is not None:
        _check_schema(parameters, f"{where}.function.parameters")
    return name


def _check_schema(schema: Any, where: str) -> None:
    """The shape of a JSON schema (xgrammar checks the rest when it compiles it)."""
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON schema (an object), got {_short(schema)}")
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if kind is not None and not all(isinstance(k, str) and k in _JSON_TYPES for k in kinds):
        raise ValueError(f"{where}.type is not a JSON type: {_short(kind)}")
    properties = schema.get("properties")
    if properties is not None:
        if not isinstance(properties, dict):
            raise ValueError(f"{where}.properties must be an object")
        for key, value in properties.items():
            _check_schema(value, f"{where}.properties.{key}"[:200])
    required = schema.get("required")
    if required is not None and (
        not isinstance(required, list) or not all(isinstance(r, str) for r in required)
    ):
        raise ValueError(f"{where}.required must be a list of property names")


def _choice(value: Any, names: set[str]) -> tuple[str, str | None]:
    if value is None:
        return "auto", None
    if isinstance(value, str):
        if value not in CHOICES:
            raise ValueError(
                f"tool_choice must be 'none', 'auto', 'required' or a function, got {_short(value)}"
            )
        return value, None
    function = value.get("function") if isinstance(value, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(name, str):
        raise ValueError(
            "tool_choice must be 'none', 'auto', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}"
        )
    if name not in names:
        raise ValueError(f"tool_choice names {_short(name)}, which is not one of the tools")
    return "named", name


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
