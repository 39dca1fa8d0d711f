"""`kvserve serve`: the OpenAI-compatible server (kvserve.serve) on one engine.

The model is resolved as `generate` resolves it (kvserve.default_model), the
engine is built before the socket opens (so /health answers 200 only once it
can serve), and the server binds the loopback interface unless --host says
otherwise: an open port is a decision, not a default.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING

from kvserve.cli.common import HelpFormatter, add_model_option, loopback_events, positive
from kvserve.cli.engine_options import add_engine_options, engine_args_from
from kvserve.pooling_params import POOLING_RULES
from kvserve.reasoning.registry import REASONING_PARSERS
from kvserve.serve.http.metrics import PREFIXES
from kvserve.serve.responses_api.store import RESPONSES_STORE_MB, RESPONSES_STORE_SIZE
from kvserve.tool_calls.registry import PARSERS

if TYPE_CHECKING:
    from kvserve.serve.http.limits import ServeLimits

API_KEY_ENV = "KVSERVE_API_KEY"
log = logging.getLogger("kvserve.serve")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)",
        description=(
            "Serve one model over OpenAI's API: /v1/models, /v1/completions, "
            "/v1/chat/completions (streaming with Server-Sent Events), /v1/responses, "
            "Anthropic's /v1/messages, /v1/embeddings, /tokenize, /detokenize, /health, "
            "/version. The model is MODEL or --model."
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "model_arg",
        nargs="?",
        metavar="MODEL",
        help="the model, as `vllm serve MODEL` takes it (the same as --model)",
    )
    add_model_option(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to bind")
    s.add_argument("--port", type=int, default=8000, help="port to bind (0: any free port)")
    s.add_argument(
        "--served-model-name",
        help="the model name clients send and /v1/models lists (default: --model as given)",
    )
    s.add_argument(
        "--api-key",
        help=f"require 'Authorization: Bearer KEY' on every route but /health and /metrics "
        f"(default: ${API_KEY_ENV} if set)",
    )
    s.add_argument(
        "--max-queued-requests",
        type=positive,
        help="answer 503 (Retry-After) once this many requests wait for their first step "
        "(default: no limit)",
    )
    s.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM / Ctrl-C: seconds running requests may finish before they are aborted",
    )
    s.add_argument(
        "--metrics-prefix",
        choices=PREFIXES,
        default="kvserve",
        help="prefix of the /metrics series; 'vllm' exports vLLM's names for its dashboards",
    )
    s.add_argument(
        "--log-requests",
        action="store_true",
        help="log each request's prompt and sampling parameters (off: logs hold no prompt text)",
    )
    s.add_argument(
        "--responses-store-size",
        type=int,
        default=RESPONSES_STORE_SIZE,
        help="/v1/responses kept for GET and previous_response_id (least recently used go "
        "first; 0: none kept)",
    )
    s.add_argument(
        "--responses-store-mb",
        type=float,
        default=RESPONSES_STORE_MB,
        help="megabytes the stored /v1/responses may take, each weighed as its JSON (least "
        "recently used go first)",
    )
    s.add_argument(
        "--tool-call-parser",
        choices=sorted(PARSERS),
        help="how tool calls are written and read (default: the family whose markers the "
        "chat template shows, else hermes)",
    )
    s.add_argument(
        "--data-parallel-size",
        type=positive,
        default=1,
        help="engines on this host, each its own `kvserve serve` on a loopback port with KV "
        "events on (ports offset by rank), behind a cache-aware router on --port",
    )
    s.add_argument(
        "--pooling",
        choices=POOLING_RULES,
        default="last",
        help="how /v1/embeddings pools a prompt's final hidden states (L2-normalized): the "
        "last token's (vLLM's default for decoder models) or the mean of all",
    )
    s.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        help="split chat answers into message.reasoning_content and content at the model's "
        "<think>...</think> (vLLM's names); structured outputs start after the reasoning",
    )
    s.add_argument(
        "--lora-modules",
        nargs="+",
        metavar="NAME=DIR",
        help="LoRA adapters (PEFT directories) served by name, each NAME=DIR or vLLM's JSON "
        '\'{"name": ..., "path": ...}\': a request\'s model picks one; turns on --enable-lora '
        "(which alone serves none until POST /v1/load_lora_adapter)",
    )
    add_limit_options(p.add_argument_group("limits (each client's; README: Serving, Limits)"))
    add_engine_options(p.add_argument_group("engine (kvserve.engine.engine_args.EngineArgs)"))
    p.set_defaults(func=run)


def add_limit_options(g: argparse._ArgumentGroup) -> None:
    from kvserve.serve.http.limits import ServeLimits

    d = ServeLimits()
    g.add_argument(
        "--max-request-bytes",
        type=positive,
        default=d.max_request_bytes,
        help="a request body larger than this is refused (413) before it is read",
    )
    g.add_argument(
        "--max-n",
        type=positive,
        help="the most completions (n) per prompt (default: the engine's --max-num-seqs)",
    )
    for name, what in (
        ("max-grammar-values", "enum, const and choice values in one request's constraint"),
        ("max-grammar-bytes", "bytes of one request's constraint (schema, regex, grammar, tools)"),
        ("max-tools", "tools one chat request may offer"),
    ):
        default = getattr(d, name.replace("-", "_"))
        g.add_argument(f"--{name}", type=positive, default=default, help=f"the most {what}")
    for name, what in (
        ("body-timeout", "a request body may take to arrive (408 past it)"),
        ("header-timeout", "a connection may take to send a request's headers (then closed)"),
        ("keep-alive-timeout", "an idle keep-alive connection is kept open"),
        ("send-timeout", "a client may leave its response unread before it is dropped"),
    ):
        default = getattr(d, name.replace("-", "_"))
        g.add_argument(f"--{name}", type=_seconds, default=default, help=f"seconds {what}")


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def limits_from(args: argparse.Namespace) -> ServeLimits:
    from kvserve.serve.http.limits import ServeLimits

    return ServeLimits(
        max_request_bytes=args.max_request_bytes,
        max_n=args.max_n,
        max_grammar_values=args.max_grammar_values,
        max_grammar_bytes=args.max_grammar_bytes,
        max_tools=args.max_tools,
        body_timeout=args.body_timeout,
        header_timeout=args.header_timeout,
        keep_alive_timeout=args.keep_alive_timeout,
        send_timeout=args.send_timeout,
    )


def model_from(args: argparse.Namespace) -> str | None:
    """MODEL or --model (both given, they must agree)."""
    if args.model_arg is not None and args.model is not None and args.model_arg != args.model:
        raise ValueError(
            f"the model is given twice, differently: {args.model_arg!r} and --model {args.model!r}"
        )
    return args.model_arg if args.model_arg is not None else args.model


def run(args: argparse.Namespace) -> int:
    args.model = model_from(args)
    if args.responses_store_size < 0:
        raise ValueError(f"--responses-store-size must be >= 0, got {args.responses_store_size}")
    if not args.responses_store_mb >= 0:
        raise ValueError(f"--responses-store-mb must be >= 0, got {args.responses_store_mb}")
    engine_args = engine_args_from(args)
    from kvserve.serve.build import lora_options  # the engine's imports: only to serve

    lora_options(args, engine_args)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if args.data_parallel_size > 1:  # the parent runs no engine: children do, a router fronts
        from kvserve.cli.data_parallel import run_data_parallel

        return run_data_parallel(args, engine_args, api_key)

    import uvicorn

    from kvserve.serve.build import build_served_engine
    from kvserve.serve.http.connections import timed_h11
    from kvserve.serve.http.engine_thread import freeze_heap
    from kvserve.serve.lifecycle import DrainingServer

    engine_args.kv_events_config = loopback_events(engine_args.kv_events_config)
    servers: list[DrainingServer] = []
    limits = limits_from(args)
    served = build_served_engine(
        args, engine_args, limits, api_key, on_death=lambda why: servers[0].engine_died(why)
    )
    llm, state, engine = served.llm, served.state, served.engine
    print(f"Serving {llm.model.description} as {state.served_name!r}", file=sys.stderr, flush=True)
    if llm.model.random_weights:
        print("(random weights: its completions are gibberish)", file=sys.stderr, flush=True)
    config = uvicorn.Config(
        served.app(),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
        # uvicorn annotates an int, and hands the seconds to call_later, which takes a float
        timeout_keep_alive=limits.keep_alive_timeout,  # type: ignore[arg-type]  # a float works
        http=timed_h11(limits.header_timeout, limits.send_timeout),
    )
    server = DrainingServer(config, state, args.shutdown_timeout)
    servers.append(server)
    freeze_heap()  # this process serves this one engine for its life
    engine.start()
    try:
        server.run()
    finally:
        served.close()
    if engine.dead is not None:
        log.error("exiting: the engine died (%s)", engine.dead)
        return 1
    if server.signalled:
        log.info("stopped")
    return 0
