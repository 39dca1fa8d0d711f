"""The targets of benchmarks/serve.py: server processes, the LLM.generate worker, the runs.

See serve.py's docstring for what each target is and why it is run so.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from serve_load import (
    Conversation,
    Run,
    Target,
    Workload,
    english,
    multi_turn,
    percentile,
    run_workload,
    shared_prefix,
)

ON, OFF, LLM_ROW, LLAMA = "kvserve, caching on", "kvserve, caching off", "LLM.generate", "llama.cpp"
START_SECONDS = 600
SCRIPT = Path(__file__).with_name("serve.py")


def note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- workloads ---------------------------------------------------------------------


def workloads(args: argparse.Namespace, tokenizer: Any, repeat: int) -> list[Workload]:
    def count(text: str) -> int:
        return len(tokenizer.encode(text))

    seed = args.seed + repeat
    out = []
    for name in args.workloads:
        if name == "shared-prefix":
            out.append(
                shared_prefix(
                    seed, args.num_requests, args.prefix_tokens, args.suffix_tokens, count
                )
            )
        else:
            out.append(
                multi_turn(
                    seed,
                    args.conversations,
                    args.turns,
                    args.first_turn_tokens,
                    args.suffix_tokens,
                    count,
                )
            )
    return out


def warm_up_prompt() -> str:
    return english(random.Random("warm-up"), 48, lambda text: len(text.split()))


# -- processes ---------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(threads: int, extra_path: str | None = None) -> dict[str, str]:
    """This interpreter's import path first (the kvserve this script runs), threads set."""
    paths = [extra_path] if extra_path else []
    paths += [p for p in sys.path if p]
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": os.pathsep.join(paths)}


class Process:
    """A server process on a free loopback port, its output in a log file."""

    def __init__(self, what: str, cmd: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.what = what
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"{what.replace(' ', '_').replace(',', '')}.log"
        with self.log.open("w") as log:
            cmd = [c.replace("{port}", str(self.port)) for c in cmd]
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.what} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise SystemExit(f"{self.what} did not answer in {START_SECONDS} s:\n{self.tail()}")

    def tail(self) -> str:
        """The end of its output (the log's folder goes away with the run)."""
        return self.log.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)


def kvserve_process(args: argparse.Namespace, label: str, extra: list[str], logs: Path) -> Process:
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--port", "{port}"]
    cmd += ["--served-model-name", "bench", "--num-threads", str(args.threads)]
    cmd += (["--model", args.model] if args.model else []) + shlex.split(args.engine_args)
    return Process(label, cmd + extra, child_env(args.threads), logs)


def llamacpp_process(args: argparse.Namespace, gguf: str, n_ctx: int, logs: Path) -> Process:
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--model_alias", "bench"]
    cmd += ["--host", "127.0.0.1", "--port", "{port}", "--n_ctx", str(n_ctx)]
    cmd += ["--n_threads", str(args.threads), "--n_threads_batch", str(args.threads)]
    cmd += ["--interrupt_requests", "False"]  # its default cancels a stream when another comes
    return Process(LLAMA, cmd, child_env(args.threads, args.llamacpp_pythonpath), logs)


def llamacpp_missing(args: argparse.Namespace, model_path: str) -> str | None:
    """Why the llama.cpp peer cannot run (one line), or None."""
    if not model_path.endswith(".gguf"):
        return f"the model is not a GGUF file ({model_path})"
    check = [sys.executable, "-c", "import llama_cpp.server.app"]
    env = child_env(args.threads, args.llamacpp_pythonpath)
    proc = subprocess.run(check, env=env, capture_output=True, text=True, timeout=120)
    if proc.returncode == 0:
        return None
    last = (proc.stderr.strip().splitlines() or ["?"])[-1]
    return (
        f"llama-cpp-python's server does not import ({last}); it needs "
        "llama-cpp-python[server] (sse-starlette, starlette-context, pydantic-settings), "
        "or --llamacpp-pythonpath DIR holding them"
    )


# -- running -----------------------------------------------------------------------


def load(
    target: Target, args: argparse.Namespace, sets: list[list[Workload]], only: str | None = None
) -> dict[str, list[Run]]:
    """Warm the target up, then run every workload (or `only` one) of every repeat on it."""
    warm = Workload("warm-up", [warm_up_prompt(), Conversation("Be brief.", ("Hello!",))], "")
    asyncio.run(run_workload(target, warm, 1, 4, float("inf"), 0))
    runs: dict[str, list[Run]] = {}
    for repeat, workload_set in enumerate(sets):
        for workload in workload_set:
            if only is not None and workload.name != only:
                continue
            note(f"  {workload.name}, repeat {repeat + 1}: {len(workload.jobs)} jobs")
            run = asyncio.run(
                run_workload(
                    target,
                    workload,
                    args.concurrency,
                    args.max_tokens,
                    args.request_rate,
                    args.seed + repeat,
                )
            )
            runs.setdefault(workload.name, []).append(run)
    return runs


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """LLM's keyword arguments from the flags every `kvserve serve` of the run gets
    (parsed by kvserve's own engine options, so both read them alike)."""
    from kvserve.cli.engine_options import add_engine_options, engine_args_from

    parser = argparse.ArgumentParser(prog="--engine-args")
    add_engine_options(parser)
    flags = [*shlex.split(args.engine_args), "--num-threads", str(args.threads)]
    return dataclasses.asdict(engine_args_from(parser.parse_args(flags)))


def llm_worker(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """In this (fresh) process: LLM.generate / LLM.chat on the same workloads."""
    from kvserve import LLM, SamplingParams

    kwargs = engine_kwargs(args)
    kwargs["max_num_seqs"] = min(kwargs["max_num_seqs"], args.concurrency)
    llm = LLM(args.model, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate([warm_up_prompt()], SamplingParams(max_tokens=4), use_tqdm=False)
    llm.chat([{"role": "user", "content": "Hello!"}], SamplingParams(max_tokens=4), use_tqdm=False)
    out: dict[str, list[dict[str, Any]]] = {}
    for repeat in range(args.repeat):
        for workload in workloads(args, llm.get_tokenizer(), repeat):
            note(f"  {workload.name}, repeat {repeat + 1}: {len(workload.jobs)} jobs")
            t0 = time.perf_counter()
            if isinstance(workload.jobs[0], str):
                outputs = [[o] for o in llm.generate(workload.jobs, params, use_tqdm=False)]
            else:
                outputs = chat_rounds(llm, workload.jobs, params)  # type: ignore[arg-type]
            wall = time.perf_counter() - t0
            flat = [o for job in outputs for o in job]
            record = {
                "wall": wall,
                "requests": len(flat),
                "prompt_tokens": sum(len(o.prompt_token_ids) for o in flat),
                "completion_tokens": sum(len(o.outputs[0].token_ids) for o in flat),
                "cached_tokens": sum(o.num_cached_tokens for o in flat),
                "texts": [o.outputs[0].text for o in flat],
            }
            out.setdefault(workload.name, []).append(record)
    return out


def chat_rounds(llm: Any, conversations: list[Conversation], params: Any) -> list[list[Any]]:
    """Each turn one LLM.chat call over all chats; outputs per chat, in turn order."""
    histories = [[{"role": "system", "content": c.system}] for c in conversations]
    outputs: list[list[Any]] = [[] for _ in conversations]
    for turn in range(len(conversations[0].user_messages)):
        for history, conversation in zip(histories, conversations, strict=True):
            history.append({"role": "user", "content": conversation.user_messages[turn]})
        for i, output in enumerate(llm.chat(histories, params, use_tqdm=False)):
            outputs[i].append(output)
            histories[i].append({"role": "assistant", "content": output.outputs[0].text})
    return outputs


def run_llm_worker(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    cmd = [sys.executable, str(SCRIPT), *sys.argv[1:], "--worker-llm"]
    proc = subprocess.run(
        cmd, env=child_env(args.threads), stdout=subprocess.PIPE, text=True, timeout=7200
    )
    if proc.returncode:
        raise SystemExit(f"the LLM.generate worker failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def llm_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """LLM.generate's row: tokens/s and the cached share (no latencies: it does not stream)."""
    totals = [(r["prompt_tokens"] + r["completion_tokens"]) / r["wall"] for r in records]
    prompt = sum(r["prompt_tokens"] for r in records)
    return {
        "requests": sum(r["requests"] for r in records),
        "errors": 0,
        "prompt_tokens_mean": prompt / sum(r["requests"] for r in records),
        "output_tps": percentile([r["completion_tokens"] / r["wall"] for r in records], 50),
        "total_tps": percentile(totals, 50),
        "total_tps_best": max(totals),
        "cached_share": sum(r["cached_tokens"] for r in records) / prompt if prompt else None,
    }
