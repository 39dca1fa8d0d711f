"""Chat's `tools`, `tool_choice` and `parallel_tool_calls` -> a ToolRequest and its grammar.

The checks and the grammar are kvserve.tool_calls' (request.py); here their
ValueErrors become 400s naming the field, and the grammar takes the request's
one constraint: a request that also sets `response_format` (or another
structured-output field) while its tools are in play is refused, naming
`tool_choice`, as two constraints are.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvserve.sampling_params import SamplingParams
from kvserve.serve.errors import APIError
from kvserve.tool_calls.parser import ToolParser
from kvserve.tool_calls.request import ToolRequest, tool_request

FIELDS = ("tools", "tool_choice", "parallel_tool_calls")


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
    `none`); a 400 when the body asked for another constraint too."""
    grammar = None if tools is None else tools.constraint(parser)
    if grammar is None:
        return params
    if params.structured_outputs is not None:
        raise APIError(
            "tools with tool_choice other than 'none' constrain the output themselves: "
            "drop response_format (or the other structured-output field), or set "
            "tool_choice 'none'",
            param="tool_choice",
        )
    return dataclasses.replace(params, structured_outputs=grammar)
