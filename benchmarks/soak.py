"""Soak: one `kvserve serve` (demo model) under valid load, then the same load with hostile
clients beside it (issue 26). Not a test: it prints a table.

    .venv/bin/python benchmarks/soak.py --minutes 1

Phases, each `--minutes` long, on one server: a warm-up (the whole mix, at
most 30 s, discarded), the baseline (valid clients only), then hostile (the same valid clients, plus
clients cycling through invalid bodies, streams left mid-way, bodies sent a
byte at a time, streams never read, prompts too long to fit). Valid clients
are closed loops of greedy streamed completions. For each phase the table
gives requests, lost valid requests (any non-200 or broken stream), errors by
kind, p50 / p99 latency of valid requests, and the server's RSS at the start
and end. Targets: hostile p99 within 1.2x the baseline's, RSS growth under 5 %
after warm-up, 0 lost valid requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

VALID_PROMPTS = ["The cache holds", "A block of tokens", "Prefix sharing means", "Hello there"]
INVALID = [
    {"prompt": "x", "seed": 2**64, "temperature": 1.0},
    {"prompt": "x", "top_k": 2**63, "top_p": 0.5},
    {"prompt": "x", "n": 10**9},
    {"prompt": [10**9]},
    {"prompt": "x", "stream": ""},
    {"prompt": "x", "x" * 100_000: 1, "max_tokens": 1},
]


@dataclass
class Phase:
    name: str
    latencies: list[float] = field(default_factory=list)
    lost: int = 0
    requests: int = 0
    kinds: Counter[str] = field(default_factory=Counter)
    rss_start: int = 0
    rss_end: int = 0


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


async def valid_client(client: httpx.AsyncClient, phase: Phase, stop: float, seed: int) -> None:
    rng = random.Random(seed)
    while time.monotonic() < stop:
        body = {
            "prompt": rng.choice(VALID_PROMPTS),
            "max_tokens": 16,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        started = time.monotonic()
        ok = False
        try:
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code == 200:
                    async for line in resp.aiter_lines():
                        if line == "data: [DONE]":
                            ok = True
                        elif line.startswith('data: {"error'):
                            break
        except httpx.HTTPError:
            pass
        phase.requests += 1
        if ok:
            phase.latencies.append(time.monotonic() - started)
        else:
            phase.lost += 1


async def raw(port: int, head: bytes, body: bytes, trickle: float = 0.0) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)
    if trickle:
        for i in range(0, len(body), max(1, len(body) // 8)):
            writer.write(body[i : i + max(1, len(body) // 8)])
            await writer.drain()
            await asyncio.sleep(trickle)
    else:
        writer.write(body)
    await writer.drain()
    return reader, writer  # type: ignore[return-value]


def request_head(body: bytes) -> bytes:
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
    )


async def hostile_client(
    client: httpx.AsyncClient, port: int, phase: Phase, stop: float, seed: int
) -> None:
    rng = random.Random(seed)
    kinds = ["invalid", "disconnect", "slow-body", "never-reads", "too-long", "half-body"]
    while time.monotonic() < stop:
        kind = rng.choice(kinds)
        phase.kinds[kind] += 1
        try:
            if kind == "invalid":
                resp = await client.post("/v1/completions", json=rng.choice(INVALID))
                phase.kinds[f"invalid->{resp.status_code}"] += 1
            elif kind == "too-long":
                resp = await client.post("/v1/completions", json={"prompt": "a " * 2_000_000})
                phase.kinds[f"too-long->{resp.status_code}"] += 1
            elif kind == "disconnect":
                body = {"prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as resp:
                    async for _ in resp.aiter_lines():
                        break
            elif kind == "slow-body":
                body = json.dumps({"prompt": "slow", "max_tokens": 4}).encode()
                reader, writer = await raw(port, request_head(body), body, trickle=0.2)
                line = await reader.readline()
                phase.kinds[f"slow-body->{line.split()[1].decode() if line else 'closed'}"] += 1
                writer.close()
            elif kind == "never-reads":
                body = json.dumps(
                    {"prompt": "x", "max_tokens": 300, "ignore_eos": True, "stream": True}
                ).encode()
                _, writer = await raw(port, request_head(body), body)
                await asyncio.sleep(2.0)
                writer.close()
            else:  # half a body, then gone
                body = json.dumps({"prompt": "x" * 1000}).encode()
                _, writer = await raw(port, request_head(body), body[:100])
                writer.close()
        except (httpx.HTTPError, OSError, IndexError):
            phase.kinds[f"{kind}->client error"] += 1


async def run_phase(
    phase: Phase, port: int, pid: int, seconds: float, valid: int, hostile: int
) -> None:
    phase.rss_start = rss(pid)
    stop = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=500, max_keepalive_connections=50)
    url = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        tasks = [valid_client(client, phase, stop, i) for i in range(valid)]
        tasks += [hostile_client(client, port, phase, stop, 1000 + i) for i in range(hostile)]
        await asyncio.gather(*tasks)
    await asyncio.sleep(1.0)
    phase.rss_end = rss(pid)


def fill_pool(port: int, num_blocks: int, block_size: int = 16) -> None:
    """Write every block of the pool once (unique prompts, prefill only): the pool's pages
    are then in RSS before the phases measure it."""
    rng = random.Random(0)
    tokens = 1000
    for _ in range(num_blocks * block_size // tokens + 2):
        prompt = [rng.randrange(100, 2000) for _ in range(tokens)]
        body = {"prompt": prompt, "max_tokens": 1}
        httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(port: int, threads: int, num_kv_blocks: int = 1024) -> subprocess.Popen:
    args = [sys.executable, "-m", "kvserve.cli", "serve", "--model", "demo:random"]
    args += ["--port", str(port), "--num-threads", str(threads), "--log-level", "warning"]
    args += ["--num-kv-blocks", str(num_kv_blocks)]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise SystemExit("the server did not start")


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return (
        statistics.quantiles(values, n=100, method="inclusive")[q - 1]
        if len(values) > 1
        else values[0]
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=0.5, help="length of each measured phase")
    p.add_argument("--valid-clients", type=int, default=4)
    p.add_argument("--hostile-clients", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="the server's --num-threads")
    p.add_argument(
        "--num-kv-blocks",
        type=int,
        default=1024,
        help="the server's pool: small, so the warm-up touches all of it (a CPU pool's pages "
        "are committed on first write, which is RSS growth but no leak)",
    )
    args = p.parse_args()
    port = free_port()
    proc = start(port, args.threads, args.num_kv_blocks)
    seconds = args.minutes * 60
    try:
        fill_pool(port, args.num_kv_blocks)
        warm = Phase("warm-up")  # the full mix: the allocator reaches its working size
        warm_seconds = min(30.0, seconds)
        mix = (args.valid_clients, args.hostile_clients)
        asyncio.run(run_phase(warm, port, proc.pid, warm_seconds, *mix))
        base = Phase("baseline")
        asyncio.run(run_phase(base, port, proc.pid, seconds, args.valid_clients, 0))
        hostile = Phase("hostile")
        asyncio.run(
            run_phase(hostile, port, proc.pid, seconds, args.valid_clients, args.hostile_clients)
        )
        alive = proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(30)
    load = os.getloadavg()
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; server --num-threads {args.threads}; "
        f"{args.valid_clients} valid + {args.hostile_clients} hostile clients, "
        f"{args.minutes:g} min per phase; load average at the end {load[0]:.1f} {load[1]:.1f}"
    )
    print(
        f"{'phase':10} {'valid req':>9} {'lost':>5} {'p50 s':>7} {'p99 s':>7} "
        f"{'RSS start MB':>12} {'RSS end MB':>10}"
    )
    for ph in (base, hostile):
        print(
            f"{ph.name:10} {ph.requests:9d} {ph.lost:5d} {pct(ph.latencies, 50):7.3f} "
            f"{pct(ph.latencies, 99):7.3f} {ph.rss_start / 2**20:12.1f} {ph.rss_end / 2**20:10.1f}"
        )
    print("hostile requests by kind (-> the status they got):")
    for kind, n in sorted(hostile.kinds.items()):
        print(f"  {kind:28} {n:6d}")
    ratio = pct(hostile.latencies, 99) / pct(base.latencies, 99)
    growth = hostile.rss_end / base.rss_start - 1
    print(
        f"p99 hostile / baseline: {ratio:.2f} (target <= 1.2); RSS growth after warm-up: "
        f"{growth * 100:+.1f} % (target < 5 %); lost valid: {base.lost + hostile.lost} "
        f"(target 0); server alive at the end: {alive}"
    )


if __name__ == "__main__":
    main()
