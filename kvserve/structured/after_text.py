"""A constraint that starts after free text: "any text without MARKER, MARKER, then the grammar".

A reasoning model thinks freely and closes its thinking with a marker
(`</think>`); its answer, not its thinking, must follow the schema. The same
shape serves any "free text until a marker, then a grammar". It is built from
xgrammar's own parts (a structural tag whose content is `any_text` up to the
marker, concatenated with the constraint's grammar) and handed back as one
EBNF grammar, so the engine compiles, caches and runs it as any other
grammar: nothing in the engine knows about markers.
"""

from __future__ import annotations

import json

import xgrammar as xgr

from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured.compiler import build_grammar


def grammar_after_text(marker: str, spec: StructuredOutputsParams) -> StructuredOutputsParams:
    """`spec`, allowed only after free text that ends with the first `marker`; ValueError
    naming the constraint when its grammar cannot be built."""
    if not marker:
        raise ValueError("the marker that ends the free text must not be empty")
    free = {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": marker}
    tag = {"type": "structural_tag", "format": free}
    prefix = xgr.Grammar.from_structural_tag(json.dumps(tag))
    grammar = xgr.Grammar.concat(prefix, build_grammar(*spec.key))
    return StructuredOutputsParams(grammar=str(grammar))
