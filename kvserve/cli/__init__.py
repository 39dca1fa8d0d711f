"""The `kvserve` command line: one module per command; this one parses and dispatches.

Besides one module per command: engine options generated from EngineArgs
(engine_options.py); `--log-level` and the log handler (common.py: only the CLI adds one;
also serve's loopback event sockets, which data_parallel shares); `generate
--prompt-token-ids` (prompt_ids.py); `generate --json-schema FILE | --json-object |
--regex | --choice | --grammar FILE` (structured_options.py); `serve --tool-call-parser
NAME` (tool_calls.registry's names); the engine commands' OpenMP runtime (openmp.py: they
re-execute themselves once with Intel's libiomp5 preloaded where it is installed); `serve
--data-parallel-size N` (data_parallel.py): N `serve` children on loopback ports, events
offset by rank, the router in front.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from kvserve.cli import chat, events, generate, kv_metadata, route, serve, simulate
from kvserve.cli.common import add_log_level, configure_logging
from kvserve.cli.openmp import reexec_with_openmp
from kvserve.version import version


class _Parser(argparse.ArgumentParser):
    """A bad option is one line on stderr (argparse's usage block would bury it), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvserve",
        description="kvserve: a compact LLM inference engine whose KV cache is exactly right.",
    )
    parser.add_argument("--version", action="version", version=f"kvserve {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (generate, chat, serve, route, kv_metadata, simulate, events):
        command.add_parser(sub)
    for command_parser in sub.choices.values():
        add_log_level(command_parser)
    return parser


ENGINE_COMMANDS = ("generate", "chat", "serve")
"""The commands that run a model: they start on Intel's OpenMP where it is installed."""


def main(argv: list[str] | None = None) -> int:
    """The command line; `argv` None means this process's own (only then may it re-execute
    itself under another OpenMP runtime: kvserve.cli.openmp)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    try:
        if argv is None and args.command in ENGINE_COMMANDS:
            reexec_with_openmp(sys.argv[1:])
        return args.func(args)
    except (ValueError, OSError) as exc:
        print(f"kvserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kvserve {args.command}: interrupted", file=sys.stderr)
        return 130
