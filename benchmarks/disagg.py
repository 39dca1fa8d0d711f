"""Prefill on one engine, decode on another, against the same two engines as replicas.

Run: .venv/bin/python benchmarks/disagg.py [--seconds 60] [--chats 6] [--long-every 4]
         [--long-tokens 2000] [--blocks 4096]

Two `kvserve serve` engines of the default model on this machine (one thread each):
- replicas: both plain, behind `kvserve route --replica A --replica B` (cache-aware);
- split: a prefill engine (kv_producer, its blocks in a CPU tier) and a decode engine
  (kv_consumer), behind `kvserve route --prefill A --decode B`.
Workload, the same on both: `--chats` streams of short chats (a question, 32 tokens
each, greedy, EOS ignored) sent back to back for `--seconds`, while a long completion
(`--long-tokens` of prompt text, 16 tokens out) arrives every `--long-every` seconds.
Printed: the chats' inter-token latency p50 and p99, their time to first token, output
tok/s of everything, the long prompts' TTFT, and for the split the transfer: bytes pulled
over the consumer's time asking, against a plain memory copy of the same bytes here.
Targets (issue 45): chat ITL p99 split / replicas <= 0.5 with output tok/s >= 0.8x.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from machine import machine_line
from serve_load import Target, english, percentile, stream
from serve_targets import Process, child_env, free_port

from kvserve.model.checkpoint.tokenizer import load_tokenizer


def kvserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvserve.cli", *args]


def events() -> str:
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "bind": True,
            "endpoint": f"tcp://127.0.0.1:{free_port()}",
            "replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
        }
    )


def start(setup: str, blocks: int, log_dir: Path) -> list[Process]:
    """The two engines and the router of `setup` ("replicas" or "split"), all ready."""
    common = ["--port", "{port}", "--num-threads", "1", "--num-kv-blocks", str(blocks)]
    env = child_env(1)
    if setup == "replicas":
        a = Process(
            "engine a", kvserve("serve", *common, "--kv-events-config", events()), env, log_dir
        )
        b = Process(
            "engine b", kvserve("serve", *common, "--kv-events-config", events()), env, log_dir
        )
        engines = [a, b]
        route = ["--replica", a.url, "--replica", b.url]
    else:
        port = free_port()
        producer = {"kv_role": "kv_producer", "kv_port": port}
        consumer = {
            "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"peers": [f"tcp://127.0.0.1:{port}"]},
        }
        a = Process(
            "prefill",
            kvserve(
                "serve",
                *common,
                "--offload",
                "cpu:2GiB",
                "--kv-transfer-config",
                json.dumps(producer),
                "--kv-events-config",
                events(),
            ),
            env,
            log_dir,
        )
        b = Process(
            "decode",
            kvserve(
                "serve",
                *common,
                "--kv-transfer-config",
                json.dumps(consumer),
                "--kv-events-config",
                events(),
            ),
            env,
            log_dir,
        )
        engines = [a, b]
        route = ["--prefill", a.url, "--decode", b.url]
    for e in engines:
        e.wait_ready()
    router = Process(f"router {setup}", kvserve("route", *route, "--port", "{port}"), env, log_dir)
    router.wait_ready()
    return [*engines, router]


async def load(url: str, args: argparse.Namespace, count) -> dict:
    target = Target(url, "SmolLM2-135M-Instruct", {"ignore_eos": True})
    rng = random.Random(0)
    long_text = [english(rng, args.long_tokens, count) for _ in range(64)]
    questions = [english(rng, 24, count) for _ in range(256)]
    chat_results, long_results = [], []
    deadline = time.perf_counter() + args.seconds
    async with httpx.AsyncClient(timeout=600) as client:

        async def chatter(i: int) -> None:
            n = 0
            while time.perf_counter() < deadline:
                body = {
                    "messages": [{"role": "user", "content": questions[(i * 37 + n) % 256]}],
                    "max_tokens": 32,
                    "temperature": 0,
                }
                chat_results.append(await stream(client, target, "/v1/chat/completions", body))
                n += 1

        async def longs() -> None:
            tasks, k = [], 0
            while time.perf_counter() < deadline:
                body = {"prompt": long_text[k % 64], "max_tokens": 16, "temperature": 0}
                tasks.append(asyncio.create_task(stream(client, target, "/v1/completions", body)))
                k += 1
                await asyncio.sleep(args.long_every)
            long_results.extend(await asyncio.gather(*tasks))

        t0 = time.perf_counter()
        await asyncio.gather(*(chatter(i) for i in range(args.chats)), longs())
        wall = time.perf_counter() - t0
    itls = [x for r in chat_results for x in r.itls]
    out = sum(r.completion_tokens for r in chat_results + long_results)
    errors = sum(1 for r in chat_results + long_results if r.error)
    return {
        "itl_p50": percentile(itls, 50),
        "itl_p99": percentile(itls, 99),
        "chat_ttft_p50": percentile([r.ttft for r in chat_results if r.ttft], 50),
        "long_ttft_p50": percentile([r.ttft for r in long_results if r.ttft], 50),
        "tok_s": out / wall,
        "chats": len(chat_results),
        "longs": len(long_results),
        "errors": errors,
    }


def transfer(decode_url: str) -> tuple[float, float]:
    """(bytes pulled, seconds asking) from the decode engine's /metrics."""
    text = httpx.get(f"{decode_url}/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        if line.startswith("kvserve:kv_transfer_"):
            name, _, value = line.partition(" ")
            values[name.split("{")[0]] = float(value)
    return (
        values.get("kvserve:kv_transfer_bytes_received_total", 0.0),
        values.get("kvserve:kv_transfer_seconds_total", 0.0),
    )


def copy_gbs(num_bytes: int) -> float:
    """A plain memory copy of `num_bytes` here, GB/s (best of 5)."""
    src = np.ones(max(num_bytes, 1 << 20), dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return src.nbytes / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--chats", type=int, default=6)
    parser.add_argument("--long-every", type=float, default=4.0)
    parser.add_argument("--long-tokens", type=int, default=2000)
    parser.add_argument("--blocks", type=int, default=4096)
    args = parser.parse_args()
    from kvserve.default_model import resolve_model

    tokenizer = load_tokenizer(resolve_model(None).path)

    def count(text: str) -> int:
        return len(tokenizer.encode(text))

    rows = {}
    moved = (0.0, 0.0)
    with tempfile.TemporaryDirectory() as tmp:
        for setup in ("replicas", "split"):
            procs = start(setup, args.blocks, Path(tmp))
            try:
                rows[setup] = asyncio.run(load(procs[-1].url, args, count))
                if setup == "split":
                    moved = transfer(procs[1].url)
            finally:
                for p in reversed(procs):
                    p.stop()
    print(f"# {datetime.date.today()}  {machine_line(1)}")
    print(
        f"# default model, 2 engines x 1 thread; {args.chats} chat streams (32 tokens) for "
        f"{args.seconds:.0f} s, a {args.long_tokens}-token prompt every {args.long_every} s"
    )
    print()
    print(
        "| setup | chats | long prompts | errors | chat ITL p50 ms | chat ITL p99 ms "
        "| chat TTFT p50 ms | long TTFT p50 ms | output tok/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for setup, r in rows.items():
        ms = {
            k: (r[k] or 0) * 1e3 for k in ("itl_p50", "itl_p99", "chat_ttft_p50", "long_ttft_p50")
        }
        print(
            f"| {setup} | {r['chats']} | {r['longs']} | {r['errors']} | {ms['itl_p50']:.1f} | "
            f"{ms['itl_p99']:.1f} | {ms['chat_ttft_p50']:.0f} | {ms['long_ttft_p50']:.0f} | "
            f"{r['tok_s']:.1f} |"
        )
    s, b = rows["split"], rows["replicas"]
    print()
    print(
        f"split / replicas: chat ITL p99 {(s['itl_p99'] or 0) / (b['itl_p99'] or 1):.2f}x "
        f"(target <= 0.5), output tok/s {s['tok_s'] / b['tok_s']:.2f}x (target >= 0.8)"
    )
    pulled, seconds = moved
    if seconds:
        print(
            f"transfer: {pulled / 1e6:.1f} MB pulled in {seconds:.2f} s asking = "
            f"{pulled / seconds / 1e9:.3f} GB/s; a memory copy of as many bytes here: "
            f"{copy_gbs(int(pulled)):.1f} GB/s"
        )


if __name__ == "__main__":
    main()
