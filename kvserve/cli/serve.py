"""`kvserve serve`: the OpenAI-compatible server (kvserve.serve) on one engine.

The model is resolved as `generate` resolves it (kvserve.default_model), the
engine is built before the socket opens (so /health answers 200 only once it
can serve), and the server binds the loopback interface unless --host says
otherwise: an open port is a decision, not a default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from kvserve.cli.common import HelpFormatter, add_model_option
from kvserve.cli.engine_options import add_engine_options, engine_args_from

API_KEY_ENV = "KVSERVE_API_KEY"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)",
        description=(
            "Serve one model over OpenAI's API: /v1/models, /v1/completions, "
            "/v1/chat/completions (streaming with Server-Sent Events), /tokenize, "
            "/detokenize, /health, /version."
        ),
        formatter_class=HelpFormatter,
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
        help=f"require 'Authorization: Bearer KEY' on every route but /health "
        f"(default: ${API_KEY_ENV} if set)",
    )
    add_engine_options(p.add_argument_group("engine (kvserve.engine.engine_args.EngineArgs)"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kvserve.llm import LLM
    from kvserve.serve.app import create_app
    from kvserve.serve.engine_thread import EngineThread
    from kvserve.serve.state import ServerState

    llm = LLM(args.model, **dataclasses.asdict(engine_args_from(args)))
    name = args.served_model_name or args.model or "SmolLM2-135M-Instruct"
    engine = EngineThread(llm.engine)
    state = ServerState(
        engine=engine,
        served_name=name,
        description=llm.model.description,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_model_len=llm.engine.scheduler.config.max_model_len,
    )
    print(f"Serving {llm.model.description} as {name!r}", file=sys.stderr, flush=True)
    if llm.model.random_weights:
        print("(random weights: its completions are gibberish)", file=sys.stderr, flush=True)
    engine.start()
    try:
        uvicorn.run(create_app(state), host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.stop()
        llm.shutdown()
    return 0
