"""`kvserve events`: watch an engine's KV cache events (a router's view of its cache)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "events",
        help="watch an engine's KV cache events",
        description=(
            "Subscribe to an engine's KV cache events, print each one and the size of the "
            "prefix index built from them. Recovers from gaps by replay or a snapshot. Until "
            "an engine answers on its replay endpoint it waits (saying so once); with "
            "--duration, no engine by then is an error."
        ),
    )
    p.add_argument("--connect", required=True, help="the engine's PUB endpoint, tcp://host:port")
    p.add_argument(
        "--replay",
        help="the engine's replay endpoint (default: the --connect port + 1)",
    )
    p.add_argument("--topic", default="", help="topic to subscribe to")
    p.add_argument(
        "--duration", type=float, help="stop after this many seconds (default: until Ctrl-C)"
    )
    p.add_argument("--quiet", action="store_true", help="print only the index size")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvserve.events.subscriber import ReplayUnavailable
    from kvserve.events.watch import watch

    replay = args.replay
    if replay is None:
        base, _, port = args.connect.rpartition(":")
        if not port.isdigit():
            raise ValueError(
                f"cannot derive a replay endpoint from {args.connect!r}: pass --replay"
            )
        replay = f"{base}:{int(port) + 1}"
    try:
        watch(args.connect, replay, topic=args.topic, duration=args.duration, quiet=args.quiet)
    except ReplayUnavailable as exc:
        raise ConnectionError(str(exc)) from None  # an OSError: one line, exit status 2
    return 0
