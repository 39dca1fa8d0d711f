"""`kvserve generate`'s structured-output options -> StructuredOutputsParams (or None).

One of them at most, as the engine takes one constraint per request; a file that
cannot be read is a ValueError naming it (the CLI's one-line error, exit 2).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvserve.sampling_params import StructuredOutputsParams


def add_structured_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "structured output (one at most; the output is constrained to it)"
    ).add_mutually_exclusive_group()
    group.add_argument("--json-schema", metavar="FILE", help="a JSON schema file")
    group.add_argument("--json-object", action="store_true", help="any JSON object")
    group.add_argument("--regex", help="the output matches this regular expression")
    group.add_argument(
        "--choice", action="append", metavar="TEXT", help="one of these (repeat the option)"
    )
    group.add_argument("--grammar", metavar="FILE", help="an EBNF (GBNF) grammar file")


def structured_from(args: argparse.Namespace) -> StructuredOutputsParams | None:
    if args.json_schema is not None:
        text = _read(args.json_schema, "--json-schema")
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--json-schema {args.json_schema}: not JSON: {exc}") from None
        return StructuredOutputsParams(json=schema)
    if args.json_object:
        return StructuredOutputsParams(json_object=True)
    if args.regex is not None:
        return StructuredOutputsParams(regex=args.regex)
    if args.choice:
        return StructuredOutputsParams(choice=args.choice)
    if args.grammar is not None:
        return StructuredOutputsParams(grammar=_read(args.grammar, "--grammar"))
    return None


def _read(path: str, flag: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{flag} {path}: not UTF-8 text ({exc.reason})") from None
