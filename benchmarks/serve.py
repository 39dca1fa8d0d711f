"""`kvserve serve` under load: streamed OpenAI requests, prefix caching on and off,
against `LLM.generate` on the same work, and optionally against llama.cpp's server.

Run: .venv/bin/python benchmarks/serve.py [--concurrency 16] [--request-rate inf]
         [--workloads shared-prefix multi-turn] [--num-requests 32] [--prefix-tokens 512]
         [--max-tokens 32] [--threads 1] [--repeat 1] [--engine-args "--dtype bfloat16"]
         [--url http://127.0.0.1:8000] [--skip-llm] [--skip-llamacpp]

Progress goes to stderr, the tables (markdown) to stdout. The workloads and the
client are in serve_load.py, the servers and the LLM.generate worker in
serve_targets.py.

Load: an asyncio client (httpx) streams every request (`stream: true`,
`stream_options.include_usage`) and times it: TTFT is the time from sending
to the first chunk that carries text, ITL the gaps between consecutive
chunks that carry text (the server sends one chunk per engine step, so a
chunk is one token except where the detokenizer held back part of a
character), E2E the whole request. `--concurrency` clients take jobs in
order; with `--request-rate R` job i starts no earlier than its Poisson
arrival time (rate R per second, seeded), otherwise as soon as a client is
free. tokens/s are the usage counts (prompt + completion; completion alone
for output tok/s) over the wall time from the first request sent to the last
one finished; the cached share is the sum of
`usage.prompt_tokens_details.cached_tokens` over the sum of `prompt_tokens`.

Workloads (English-like text from a seeded word list, sized with the
model's tokenizer; a fresh set for each repeat, so no repeat finds the
previous one's prompts in the cache):
- `shared-prefix` (`/v1/completions`): `--num-requests` prompts, each one
  shared document of `--prefix-tokens` tokens plus a distinct question of
  about `--suffix-tokens`.
- `multi-turn` (`/v1/chat/completions`): `--conversations` chats of
  `--turns` turns; the first user message a document of about
  `--first-turn-tokens` (each chat its own), later ones about
  `--suffix-tokens`; every turn's prompt is the whole history, the model's
  answers included, so it extends the previous turn's prompt. A chat's turns
  are sequential (a client sends turn k+1 once turn k is answered).
Every request: greedy, `max_tokens` = `--max-tokens`, `ignore_eos` (so every
answer has exactly that many tokens, whatever the engine).

Targets, one after the other, each with the same engine flags (`--threads`,
`--engine-args`, the model), warmed up by two short requests first:
- kvserve, caching on, and kvserve, caching off (`--no-enable-prefix-caching`):
  `kvserve serve` started by this script on a free loopback port and stopped
  after its runs. With `--url` the running server there is the only kvserve
  target (its flags are its own; say them with --engine-args so that
  LLM.generate uses the same).
- LLM.generate: the same prompts in a fresh process with the same engine
  flags, for the HTTP layer's cost (server ÷ LLM.generate total tokens/s,
  target >= 0.9). To be fair, `max_num_seqs` is capped at `--concurrency`
  (the server never has more requests than clients), all of a workload's
  prompts go into one `generate` call (continuous batching admits the next
  one as soon as one finishes, as the next client request would), and for
  `multi-turn` each turn is one `LLM.chat` call over all chats (a chat's
  turns are sequential there too; since every answer has the same length,
  the turns of different chats end together on the server as well, so the
  barrier between calls costs little). Same prompt rendering (the chat
  template) inside the timing. With `--request-rate` the server is paced and
  LLM.generate is not: the ratio then measures the pacing, not HTTP.
- llama.cpp (optional, `shared-prefix` only): llama-cpp-python's OpenAI
  server (`python -m llama_cpp.server`) on the same GGUF with the same
  thread count, the same prompts and max_tokens, greedy, end-of-sequence and
  the other special tokens banned by a logit bias of -100 (its replacement
  for ignore_eos). Its stream carries no usage: prompt tokens are counted
  with kvserve's tokenizer of the same GGUF, output tokens are max_tokens
  for answers that ran to their length. It serves one request at a time
  (started with `--interrupt_requests False`: by default a new request
  cancels the running stream) and reuses the previous request's KV for
  their common prefix. It needs llama-cpp-python's server extras
  (sse-starlette, starlette-context, pydantic-settings); without them it is
  skipped with a note. `--llamacpp-pythonpath DIR` puts a folder holding
  them first on its PYTHONPATH only, e.g. after `pip install --no-deps
  --target DIR sse-starlette 'starlette-context<0.4' pydantic-settings
  python-dotenv`.

Figures: latency percentiles over all requests of all repeats; tokens/s the
median over repeats. The client runs in this process and takes CPU time of
its own (parsing every chunk): on a small machine leave it a core (the
default `--threads 1` on two cores does). The Mooncake trace under
shared/data holds block hashes, not text, so it cannot feed a server;
the prompts here are generated text.

Ratios: TTFT p50 caching on ÷ off (target <= 0.3 on shared-prefix at
concurrency 16), server ÷ LLM.generate total tokens/s (target >= 0.9),
kvserve (caching on) ÷ llama.cpp for TTFT p50 and tokens/s; and whether the
greedy answers of the server (caching on) equal LLM.generate's.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
from machine import machine_line
from serve_load import Run, Target, Workload, summarize
from serve_targets import (
    LLAMA,
    LLM_ROW,
    OFF,
    ON,
    engine_kwargs,
    kvserve_process,
    llamacpp_missing,
    llamacpp_process,
    llm_summary,
    llm_worker,
    load,
    note,
    run_llm_worker,
    workloads,
)

from kvserve.cli.common import positive

WORKLOADS = ("shared-prefix", "multi-turn")
BANNED_LOGIT = -100
"""llama.cpp's stand-in for ignore_eos: special tokens (EOS among them) get this logit bias."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", help="checkpoint; kvserve's default model (a GGUF) when not given")
    p.add_argument("--url", help="load the kvserve server running there instead of starting two")
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--concurrency", type=positive, default=16, help="clients (requests in flight)")
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrivals per second (inf: as fast as concurrency allows)",
    )
    p.add_argument("--num-requests", type=positive, default=32, help="shared-prefix prompts")
    p.add_argument("--prefix-tokens", type=positive, default=512, help="shared-prefix: shared part")
    p.add_argument(
        "--suffix-tokens",
        type=positive,
        default=32,
        help="shared-prefix: each question; multi-turn: each later user message",
    )
    p.add_argument("--conversations", type=positive, default=16, help="multi-turn chats")
    p.add_argument("--turns", type=positive, default=3, help="multi-turn: turns per chat")
    p.add_argument("--first-turn-tokens", type=positive, default=256, help="multi-turn: 1st turn")
    p.add_argument("--max-tokens", type=positive, default=32, help="output tokens of every request")
    p.add_argument("--threads", type=positive, default=1, help="CPU threads of every engine")
    p.add_argument("--repeat", type=positive, default=1, help="runs of each workload (new prompts)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (repeat r uses seed + r)")
    p.add_argument(
        "--engine-args",
        default="",
        help="more engine flags of `kvserve serve`, for every kvserve target, e.g. "
        "'--dtype bfloat16 --block-size 32'",
    )
    p.add_argument("--skip-llm", action="store_true", help="no LLM.generate comparison")
    p.add_argument("--skip-llamacpp", action="store_true", help="no llama.cpp peer")
    p.add_argument(
        "--llamacpp-pythonpath",
        metavar="DIR",
        help="a folder put first on the llama.cpp server's PYTHONPATH (its server extras)",
    )
    p.add_argument("--worker-llm", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.request_rate <= 0:
        p.error("--request-rate must be positive")
    engine_kwargs(args)  # a bad --engine-args fails here, before any server starts
    return args


def main() -> int:
    args = parse_args()
    if args.worker_llm:
        print(json.dumps(llm_worker(args)))
        return 0
    from kvserve.default_model import resolve_model
    from kvserve.model.checkpoint.tokenizer import load_tokenizer

    try:
        model = resolve_model(args.model)
        note(f"loading the tokenizer of {model.description}")
        tokenizer = load_tokenizer(model.path)
    except ValueError as exc:  # a missing model or a bad checkpoint: one line
        raise SystemExit(f"error: {exc}") from None
    if tokenizer is None:
        raise SystemExit(f"error: {model.description} has no tokenizer; the prompts are text")
    sets = [workloads(args, tokenizer, repeat) for repeat in range(args.repeat)]
    runs: dict[str, dict[str, list[Run]]] = {}
    notes: list[str] = []
    ignore_eos = {"ignore_eos": True}
    with tempfile.TemporaryDirectory(prefix="kvserve-servebench-") as logs:
        if args.url:
            url = args.url.rstrip("/")
            served = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
            note(f"kvserve at {url} ({served})")
            runs[f"kvserve at {url}"] = load(Target(url, served, ignore_eos), args, sets)
        else:
            for label, extra in ((ON, []), (OFF, ["--no-enable-prefix-caching"])):
                note(f"{label}: starting kvserve serve")
                server = kvserve_process(args, label, extra, Path(logs))
                try:
                    server.wait_ready()
                    runs[label] = load(Target(server.url, "bench", ignore_eos), args, sets)
                finally:
                    server.stop()
        llm = None
        if not args.skip_llm:
            note(f"{LLM_ROW}: in a fresh process")
            llm = run_llm_worker(args)
        if "shared-prefix" in args.workloads and not args.skip_llamacpp:
            why = llamacpp_missing(args, model.path)
            if why:
                notes.append(f"llama.cpp skipped: {why}.")
                note(notes[-1])
            else:
                runs[LLAMA] = run_llamacpp(args, model.path, tokenizer, sets, Path(logs))
    print_report(args, model.description, sets, runs, llm, notes)
    return 0


def run_llamacpp(
    args: argparse.Namespace, gguf: str, tokenizer: Any, sets: list[list[Workload]], logs: Path
) -> dict[str, list[Run]]:
    def count(text: str) -> int:
        return len(tokenizer.encode(text))

    longest = max(count(p) for s in sets for w in s if w.name == "shared-prefix" for p in w.jobs)
    n_ctx = -(-(longest + args.max_tokens + 64) // 256) * 256  # type: ignore[operator]
    note(f"{LLAMA}: starting llama_cpp.server (n_ctx {n_ctx})")
    server = llamacpp_process(args, gguf, n_ctx, logs)
    bias = {str(i): BANNED_LOGIT for i in tokenizer.all_special_ids}
    try:
        server.wait_ready()
        target = Target(server.url, "bench", {"logit_bias": bias}, prompt_tokens=count)
        return load(target, args, sets, only="shared-prefix")
    finally:
        server.stop()


# -- the report --------------------------------------------------------------------


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def fmt(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if value is None else f"{value * scale:,.{digits}f}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"**{a / b:.2f}**"


def table(header: list[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()


def print_report(
    args: argparse.Namespace,
    model: str,
    sets: list[list[Workload]],
    runs: dict[str, dict[str, list[Run]]],
    llm: dict[str, list[dict[str, Any]]] | None,
    notes: list[str],
) -> None:
    rate = f"{args.request_rate:g}/s (Poisson)"
    if args.request_rate == float("inf"):
        rate = "as fast as concurrency allows"
    print(
        f"{datetime.date.today()}  {machine_line()}, Python "
        f"{platform.python_version()}, torch {version('torch')}, kvserve {version('kvserve')}; "
        f"{model}\n"
    )
    table(
        ["threads", "concurrency", "request rate", "max_tokens", "repeats", "engine flags"],
        [
            [
                str(args.threads),
                str(args.concurrency),
                rate,
                f"{args.max_tokens} (greedy, ignore_eos)",
                str(args.repeat),
                f"`{args.engine_args}`" if args.engine_args else "defaults",
            ]
        ],
    )
    summaries = {
        label: {w: summarize(r) for w, r in per.items()}
        for label, per in runs.items()
        if label != LLAMA
    }
    if llm is not None:
        summaries[LLM_ROW] = {w: llm_summary(records) for w, records in llm.items()}
    if LLAMA in runs:
        summaries[LLAMA] = {w: summarize(r) for w, r in runs[LLAMA].items()}
    first = next(iter(summaries.values()))
    rows = []
    for w in sets[0]:
        requests = len(w.jobs) * (1 if w.name == "shared-prefix" else args.turns)
        mean = first.get(w.name, {}).get("prompt_tokens_mean")
        rows.append([w.name, str(requests), fmt(mean, digits=0), w.shape])
    table(["workload", "requests per repeat", "prompt tokens (mean)", "shape"], rows)
    rows = []
    for label, per in summaries.items():
        for name, s in per.items():
            rows.append(
                [label, name, str(s["requests"])]
                + [fmt(s.get(k), 1000) for k in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99")]
                + [fmt(s.get("e2e_p50"), digits=2), fmt(s["output_tps"]), fmt(s["total_tps"])]
                + [fmt(s["cached_share"], 100) + ("%" if s["cached_share"] is not None else "")]
            )
            if s["errors"]:
                notes.append(f"{label}, {name}: {s['errors']} failed, e.g. {s['first_error']}")
    header = ["target", "workload", "requests", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms"]
    header += ["ITL p99 ms", "E2E p50 s", "output tok/s", "total tok/s", "cached share"]
    table(header, rows)
    print_ratios(summaries, runs, llm)
    for line in notes:
        print(line)


def print_ratios(
    summaries: dict[str, dict[str, dict[str, Any]]],
    runs: dict[str, dict[str, list[Run]]],
    llm: dict[str, list[dict[str, Any]]] | None,
) -> None:
    server = next((label for label in runs if label != LLAMA), None)
    if server is None:
        return
    on, off, gen = summaries[server], summaries.get(OFF, {}), summaries.get(LLM_ROW, {})
    rows = []
    for name, s in on.items() if off or gen else ():
        equal = "-"
        if llm is not None and name in llm:
            ours = [r.text for run in runs[server][name] for job in run.results for r in job]
            theirs = [t for record in llm[name] for t in record["texts"]]
            same = sum(a == b for a, b in zip(ours, theirs, strict=False))
            equal = f"{same} of {len(theirs)}"
        o, g = off.get(name, {}), gen.get(name, {})
        rows.append(
            [
                name,
                ratio(s["ttft_p50"], o.get("ttft_p50")),
                ratio(s["total_tps"], o.get("total_tps")),
                ratio(s["total_tps"], g.get("total_tps")),
                equal,
            ]
        )
    header = ["workload", "TTFT p50 caching on ÷ off (target ≤ 0.3)", "total tok/s on ÷ off"]
    header += ["server ÷ LLM.generate total tok/s (target ≥ 0.9)", "greedy answers = LLM.generate"]
    if rows:
        table(header, rows)
    peer = summaries.get(LLAMA, {}).get("shared-prefix")
    if peer is not None:
        s = on["shared-prefix"]
        keys = {"TTFT p50": "ttft_p50", "output tok/s": "output_tps", "total tok/s": "total_tps"}
        table(
            ["workload", *(f"{k} kvserve ÷ llama.cpp" for k in keys)],
            [["shared-prefix", *(ratio(s[k], peer[k]) for k in keys.values())]],
        )


if __name__ == "__main__":
    sys.exit(main())
