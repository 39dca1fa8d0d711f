"""Chat's `tools`, `tool_choice` and `parallel_tool_calls` -> a ToolRequest and its grammar.

The checks and the grammar are kvserve.tool_calls' (request.py); here their
ValueErrors become 400s naming the field, and the grammar becomes the request's
one constraint. A `response_format` (or another structured-output field) sent
with tools is composed into it: with `auto` the reply is calls or an answer
matching it (the Agents SDK sends both for an agent with an `output_type`); with
forced calls it does not apply (the calls are the answer).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvserve.sampling_params import SamplingParams
from kvserve.serve.http.errors import APIError
from kvserve.structured.tags import as_format
from kvserve.tool_calls.parser import ToolParser
from kvserve.tool_calls.request import ToolRequest, tool_request

FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
_ENGINE_NAME = "structured_outputs.structural_tag"


def read_tools(body: dict[str, Any]) -> ToolRequest | None:
    """The request's tools, checked (None: it offers none); a 400 naming the field."""
    try:
        return tool_request(
            body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
        )
    except ValueError as exc:
        message = str(exc)
        param = next((f for f in FIELDS if message.startswith(f)), "tools")
        raise APIError(message, param=param) from None


def constrained(
    params: SamplingParams, tools: ToolRequest | None, parser: ToolParser
) -> SamplingParams:
    """`params` with the tools' grammar as its constraint (unchanged for no tools or
    `none`). A constraint the body also asked for (`response_format`, ...) is what an
    `auto` reply without calls must match; forced calls are the whole answer."""
    if tools is None or not tools.parses:
        return params
    other = params.structured_outputs
    try:
        answer = None if other is None or tools.choice != "auto" else as_format(other)
    except ValueError as exc:
        raise APIError(str(exc), param="response_format") from None
    grammar = tools.constraint(parser, answer)
    return dataclasses.replace(params, structured_outputs=grammar)


def as_sent(message: str) -> str:
    """The engine's refusal of the tools' grammar in the client's words (it names the
    constraint `structured_outputs.structural_tag`; the client sent tools)."""
    return message.replace(_ENGINE_NAME, "tools: a function's parameters schema", 1)
