"""`kvserve route`: one OpenAI-compatible endpoint in front of several `kvserve serve` replicas."""

from __future__ import annotations

import argparse
import logging
import os

from kvserve.cli.common import HelpFormatter, parse_bytes
from kvserve.cli.serve import API_KEY_ENV
from kvserve.routing import POLICIES


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "route",
        help="an OpenAI-compatible router over several `kvserve serve` replicas",
        description=(
            "Forward OpenAI requests to the replica a routing policy chooses. cache-aware "
            "predicts each replica's prefix-cache hit from its KV events (each replica needs "
            "--kv-events-config with enable_kv_cache_events and a replay_endpoint) and the "
            "request tokenized as the replicas tokenize it."
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--replica",
        action="append",
        default=[],
        metavar="URL",
        help="a replica's base URL, e.g. http://127.0.0.1:8001 (repeat for each)",
    )
    p.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="URL",
        help="a prefill engine (kv_transfer_config kv_producer): each request's prompt runs "
        "there first, then the request on a --decode engine, which pulls its blocks",
    )
    p.add_argument(
        "--prefill-min-tokens",
        type=int,
        default=256,
        metavar="N",
        help="with --prefill: a prompt with fewer uncached tokens skips the prefill engine "
        "(the decode engine computes it sooner than it would wait there)",
    )
    p.add_argument(
        "--prefill-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="with --prefill: a prefill engine that has not answered by then is left (its "
        "request aborted there) and the decode engine computes the prompt (default: 30)",
    )
    p.add_argument(
        "--decode",
        action="append",
        default=[],
        metavar="URL",
        help="a decode engine (kv_transfer_config kv_consumer of the --prefill engines)",
    )
    p.add_argument("--policy", choices=POLICIES, default="cache-aware", help="routing policy")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=8000, help="port to bind (0: any free port)")
    p.add_argument(
        "--api-key",
        help="wanted from clients on every route but /health and /metrics, and sent to the "
        f"replicas (default: ${API_KEY_ENV} if set)",
    )
    p.add_argument(
        "--model",
        help="where to read the replicas' tokenizer and chat template (default: the checkpoint "
        "path the replicas report in /kv-metadata)",
    )
    p.add_argument(
        "--wait",
        type=float,
        default=30.0,
        help="seconds to wait at start for each replica to answer",
    )
    p.add_argument(
        "--health-interval",
        type=float,
        default=1.0,
        help="seconds between two /health checks of each replica",
    )
    p.add_argument(
        "--max-request-bytes",
        type=parse_bytes,
        metavar="SIZE",
        help="a larger request body is refused with 413 before it is read whole (bytes, or "
        "a size such as 16MiB; default: 16MiB, as serve)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM / Ctrl-C: seconds the requests in flight may finish",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvserve.router import build_router, serve_router

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per health check otherwise
    if bool(args.prefill) != bool(args.decode):
        raise ValueError("--prefill and --decode go together (prefill on one, decode on another)")
    if not 0 < args.prefill_timeout <= 3600:
        raise ValueError(
            f"--prefill-timeout must be in (0, 3600] seconds, got {args.prefill_timeout}"
        )
    if not (args.replica or args.prefill):
        raise ValueError("give the replicas: --replica URL, or --prefill URL and --decode URL")
    state = build_router(
        [*args.replica, *args.prefill, *args.decode],
        policy=args.policy,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        model=args.model,
        wait=args.wait,
        health_interval=args.health_interval,
        max_request_bytes=args.max_request_bytes,  # None: the router's default
        roles={**dict.fromkeys(args.prefill, "prefill"), **dict.fromkeys(args.decode, "decode")},
    )
    state.prefill_min_tokens = args.prefill_min_tokens
    state.prefill_timeout = args.prefill_timeout
    if serve_router(state, args.host, args.port, args.shutdown_timeout, args.log_level):
        logging.getLogger("kvserve.router").info("stopped")
    return 0
