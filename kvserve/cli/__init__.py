"""The `kvserve` command line: one module per command; this one parses and dispatches."""

from __future__ import annotations

import argparse
import sys

from kvserve.cli import chat, events, generate, kv_metadata, route, serve, simulate


def version() -> str:
    """The installed distribution's version; the source tree's when it is not installed."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("kvserve")
    except PackageNotFoundError:
        from kvserve import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvserve",
        description="kvserve: a compact LLM inference engine whose KV cache is exactly right.",
    )
    parser.add_argument("--version", action="version", version=f"kvserve {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (generate, chat, serve, route, kv_metadata, simulate, events):
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as exc:
        print(f"kvserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
