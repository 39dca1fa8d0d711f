"""How large a constraint may be before it is compiled: values, bytes and tools.

A grammar's compile time grows faster than its size (a 5,000-value enum
compiles in 0.1 s on the demo tokenizer, a 30,000-value one in 7 s, and the
compiled grammar holds 100 MB), so what a request may ask is bounded here,
on the handler's thread, before anything is tokenized or compiled: each a 400
naming the field the client sent and the option that sets the limit. At the
defaults the worst constraint (a 4,096-value enum filling the 256 KiB) compiles
in about 2.6 s on SmolLM2's tokenizer and holds 47 MB. The
compile itself still has a deadline (--grammar-compile-timeout) and runs on
a pool of workers (kvserve.structured.compiler).
"""

from __future__ import annotations

import json
from typing import Any

from kvserve.sampling_params import SamplingParams
from kvserve.serve.http.errors import APIError
from kvserve.serve.http.limits import ServeLimits
from kvserve.tool_calls.request import ToolRequest


def check_tools(tools: ToolRequest | None, limits: ServeLimits) -> None:
    """At most --max-tools tools."""
    if tools is not None and len(tools.tools) > limits.max_tools:
        raise APIError(
            f"tools has {len(tools.tools)} entries; at most {limits.max_tools} (--max-tools)",
            param="tools",
        )


def check_grammar(params: SamplingParams, source: str | None, limits: ServeLimits) -> None:
    """The request's one constraint (a schema, choices, a regex or grammar, the tools'
    grammar): at most --max-grammar-bytes of text and --max-grammar-values enum, const
    and choice values. `source`: the field the client sent it in."""
    spec = params.structured_outputs
    if spec is None:
        return
    kind, text = spec.key
    name = source or "structured_outputs"
    size = len(text.encode())
    if size > limits.max_grammar_bytes:
        raise APIError(
            f"{name}: the constraint is {size} bytes; at most {limits.max_grammar_bytes} "
            "(--max-grammar-bytes)",
            param=name,
        )
    if kind == "choice":
        values = len(spec.choice or ())
    elif kind in ("json", "structural_tag"):
        try:  # request/structured.py read the client's text already: this is ours, or that
            values = _values(json.loads(text))
        except (ValueError, RecursionError):
            raise APIError(f"{name}: the constraint is not valid JSON", param=name) from None
    else:
        return
    if values > limits.max_grammar_values:
        raise APIError(
            f"{name}: the constraint has {values} enum, const or choice values; at most "
            f"{limits.max_grammar_values} (--max-grammar-values)",
            param=name,
        )


def _values(schema: Any) -> int:
    """The `enum` entries and `const`s anywhere in a schema (read without recursion: the
    nesting is the client's)."""
    count = 0
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            enum = node.get("enum")
            if isinstance(enum, list):
                count += len(enum)
            if "const" in node:
                count += 1
            stack.extend(v for k, v in node.items() if k not in ("enum", "const"))
        elif isinstance(node, list):
            stack.extend(node)
    return count
