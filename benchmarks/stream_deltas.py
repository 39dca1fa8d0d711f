"""What one streamed delta costs the server as the answer grows, per endpoint shape.

Run: .venv/bin/python benchmarks/stream_deltas.py [--deltas 512] [--chars 4] [--repeat 5]

Each row streams one answer of `--deltas` engine outputs (`--chars` characters
each) through the handler's own formatter, `Job.delta_chunk` and the SSE line
(kvserve/serve/generation/job.py, stream.py), on the event loop's thread as the
server runs it, with no engine and no HTTP: completions, plain chat, chat with
`--reasoning-parser qwen3` (the answer inside `<think>`), and chat with tools
whose answer is one long call (hermes, llama3_json: its arguments stream as it
grows). Cells: CPU microseconds per delta (`time.process_time`, the median over
`--repeat` runs) in each eighth of the stream, and last ÷ first eighth: 1.0
when a delta costs the same however long the answer already is; a formatter
that re-reads the whole answer each delta grows linearly (quadratic in all).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import platform
import statistics
import time
from collections.abc import Callable

from machine import machine_line

from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.serve.generation.job import Job, Part
from kvserve.serve.generation.stream import sse
from kvserve.serve.request.protocol import ResponseOptions
from kvserve.serve.request.reasoning import chat_reasoning
from kvserve.tool_calls.registry import parser_named

EIGHTHS = 8


def answer(shape: str, length: int) -> str:
    """An answer of about `length` characters in the shape the row streams."""
    words = ("word " * (length // 5 + 1))[:length]
    arguments = json.dumps({"text": words})
    if shape == "reasoning":
        return f"<think>{words}</think>done"
    if shape == "hermes":
        return f'<tool_call>\n{{"name": "write", "arguments": {arguments}}}\n</tool_call>'
    if shape == "llama3_json":
        return f'{{"name": "write", "parameters": {arguments}}}'
    return words


def make_job(shape: str) -> Job:
    chat = shape != "completions"
    options = ResponseOptions(stream=True, include_usage=True)
    job = Job("bench", chat, "m", 0, 1, options, asyncio.Queue())
    job.parts["bench"] = Part(index=0, prompt_tokens=256)
    if shape == "reasoning":
        job.reasoning, _ = chat_reasoning("qwen3", {}, SamplingParams(), "response_format")
    if shape in ("hermes", "llama3_json"):
        job.tool_parser = parser_named(shape)
    return job


def stream_once(shape: str, deltas: int, chars: int) -> list[float]:
    """CPU microseconds per delta in each eighth of one streamed answer."""
    text = answer(shape, deltas * chars)
    pieces = [text[i : i + chars] for i in range(0, len(text), chars)]
    job = make_job(shape)
    per_eighth = [0.0] * EIGHTHS
    counts = [0] * EIGHTHS
    clock: Callable[[], float] = time.process_time
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        output = RequestOutput(
            "bench",
            None,
            [],
            [CompletionOutput(0, piece, [i], finish_reason="length" if last else None)],
            finished=last,
        )
        start = clock()
        chunk = job.delta_chunk(output)
        if chunk is not None:
            sse(chunk)
        eighth = i * EIGHTHS // len(pieces)
        per_eighth[eighth] += clock() - start
        counts[eighth] += 1
    return [1e6 * t / max(1, n) for t, n in zip(per_eighth, counts, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deltas", type=int, default=512)
    parser.add_argument("--chars", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(
        f"# {datetime.date.today()}, {machine_line()}, "
        f"Python {platform.python_version()}; {args.deltas} "
        f"deltas of {args.chars} chars; CPU us per delta by eighth of the stream, "
        f"median of {args.repeat} runs"
    )
    header = " ".join(f"{k + 1}/8".rjust(7) for k in range(EIGHTHS))
    print(f"{'shape':12} {header} {'last/first':>10}")
    for shape in ("completions", "chat", "reasoning", "hermes", "llama3_json"):
        runs = [stream_once(shape, args.deltas, args.chars) for _ in range(args.repeat)]
        cells = [statistics.median(run[k] for run in runs) for k in range(EIGHTHS)]
        row = " ".join(f"{c:7.1f}" for c in cells)
        print(f"{shape:12} {row} {cells[-1] / cells[0]:10.2f}", flush=True)


if __name__ == "__main__":
    main()
