"""Soak: one `kvserve serve` (demo model) under valid load, then the same load with hostile
clients beside it (issue 26). Not a test: it prints a table.

    .venv/bin/python benchmarks/soak.py --minutes 1

Phases, each `--minutes` long, on one server: a warm-up (the whole mix, at
most 30 s, discarded), the baseline (valid clients only), hostile (the same
valid clients, plus clients cycling through invalid bodies, streams left
mid-way, bodies sent in pieces, streams never read, prompts too long to fit),
then "same work" (the same valid clients, plus a replay of every request the
hostile phase made the engine run, at the same moments, each closed after the
same time, by a well-behaved client). Valid clients are closed loops of greedy
streamed completions in this process; the hostile and replaying clients run in
a process of their own with their bodies encoded once, so their client-side
work never stalls the valid clients' event loop (on a real network they are
other machines). For each phase the table gives requests, lost valid requests
(any non-200 or broken stream), p50 / p99 latency of valid requests, and the
server's RSS at the start and end; then errors by kind. Targets: hostile p99
within 1.2x the baseline's, RSS growth under 5 % after warm-up, 0 lost valid
requests. The hostile clients' streams are valid requests the engine runs
until their clients go; "same work" is that load without the hostility, so
hostile / same work is what the hostility itself costs the others.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import httpx
from machine import machine_line

VALID_PROMPTS = ["The cache holds", "A block of tokens", "Prefix sharing means", "Hello there"]
INVALID = [
    {"prompt": "x", "seed": 2**64, "temperature": 1.0},
    {"prompt": "x", "top_k": 2**63, "top_p": 0.5},
    {"prompt": "x", "n": 10**9},
    {"prompt": [10**9]},
    {"prompt": "x", "stream": ""},
    {"prompt": "x", "x" * 100_000: 1, "max_tokens": 1},
]


Replay = tuple[float, bytes, float]
"""A request the engine ran for a hostile client: (seconds into the phase, body, seconds the
client held it before going)."""


@dataclass
class Phase:
    name: str
    latencies: list[float] = field(default_factory=list)
    lost: int = 0
    requests: int = 0
    kinds: Counter[str] = field(default_factory=Counter)
    rss_start: int = 0
    rss_end: int = 0
    replay: list[Replay] = field(default_factory=list)


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


async def raw(
    port: int, head: bytes, body: bytes, trickle: float = 0.0
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)
    if trickle:
        step = max(1, len(body) // 8)
        for i in range(0, len(body), step):
            writer.write(body[i : i + step])
            await writer.drain()
            await asyncio.sleep(trickle)
    else:
        writer.write(body)
    await writer.drain()
    return reader, writer


def request_head(body: bytes) -> bytes:
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
    )


def encoded(body: dict) -> bytes:
    return json.dumps(body).encode()


INVALID_BODIES = [encoded(b) for b in INVALID]
TOO_LONG = encoded({"prompt": "a " * 2_000_000})
DISCONNECT = encoded({"prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True})
SLOW_BODY = encoded({"prompt": "slow", "max_tokens": 4})
NEVER_READS = encoded({"prompt": "x", "max_tokens": 300, "ignore_eos": True, "stream": True})
HALF_BODY = encoded({"prompt": "x" * 1000})
JSON_HEADERS = {"content-type": "application/json"}


async def hostile_client(
    client: httpx.AsyncClient,
    port: int,
    kinds_seen: Counter[str],
    replay: list[Replay],
    start: float,
    stop: float,
    seed: int,
) -> None:
    rng = random.Random(seed)
    kinds = ["invalid", "disconnect", "slow-body", "never-reads", "too-long", "half-body"]
    while time.monotonic() < stop:
        kind = rng.choice(kinds)
        kinds_seen[kind] += 1
        began = time.monotonic()
        try:
            if kind == "invalid":
                body = rng.choice(INVALID_BODIES)
                resp = await client.post("/v1/completions", content=body, headers=JSON_HEADERS)
                kinds_seen[f"invalid->{resp.status_code}"] += 1
                if resp.status_code == 200:  # served: the engine ran it
                    replay.append((began - start, body, time.monotonic() - began))
            elif kind == "too-long":
                resp = await client.post("/v1/completions", content=TOO_LONG, headers=JSON_HEADERS)
                kinds_seen[f"too-long->{resp.status_code}"] += 1
            elif kind == "disconnect":
                req = client.build_request(
                    "POST", "/v1/completions", content=DISCONNECT, headers=JSON_HEADERS
                )
                resp = await client.send(req, stream=True)
                async for _ in resp.aiter_lines():
                    break
                await resp.aclose()
                replay.append((began - start, DISCONNECT, time.monotonic() - began))
            elif kind == "slow-body":
                reader, writer = await raw(port, request_head(SLOW_BODY), SLOW_BODY, trickle=0.2)
                line = await reader.readline()
                kinds_seen[f"slow-body->{line.split()[1].decode() if line else 'closed'}"] += 1
                writer.close()
                replay.append((began - start, SLOW_BODY, time.monotonic() - began))
            elif kind == "never-reads":
                _, writer = await raw(port, request_head(NEVER_READS), NEVER_READS)
                await asyncio.sleep(2.0)
                writer.close()
                replay.append((began - start, NEVER_READS, time.monotonic() - began))
            else:  # half a body, then gone
                _, writer = await raw(port, request_head(HALF_BODY), HALF_BODY[:100])
                writer.close()
        except (httpx.HTTPError, OSError, IndexError):
            kinds_seen[f"{kind}->client error"] += 1


async def replayed_request(client: httpx.AsyncClient, start: float, item: Replay) -> None:
    """The engine work of one hostile request, asked for by a client that reads what it gets
    and closes its stream after the same time (as a user who cancels does)."""
    offset, body, held = item
    await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
    try:
        async with asyncio.timeout(held):
            req = client.build_request(
                "POST", "/v1/completions", content=body, headers=JSON_HEADERS
            )
            resp = await client.send(req, stream=True)
            try:
                async for _ in resp.aiter_raw():
                    pass
            finally:
                await resp.aclose()
    except (TimeoutError, httpx.HTTPError):
        pass


async def side_clients(
    port: int, seconds: float, hostile: int, schedule: list[Replay] | None
) -> tuple[Counter[str], list[Replay]]:
    start = time.monotonic()
    limits = httpx.Limits(max_connections=500, max_keepalive_connections=50)
    kinds: Counter[str] = Counter()
    replay: list[Replay] = []
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}", timeout=60, limits=limits
    ) as client:
        if schedule is None:
            stop = start + seconds
            await asyncio.gather(
                *(
                    hostile_client(client, port, kinds, replay, start, stop, 1000 + i)
                    for i in range(hostile)
                )
            )
        else:
            await asyncio.gather(*(replayed_request(client, start, item) for item in schedule))
    return kinds, replay


def side_process(
    port: int, seconds: float, hostile: int, schedule: list[Replay] | None
) -> tuple[Counter[str], list[Replay]]:
    """Entry point of the side process: the hostile clients, or the replay of their work."""
    return asyncio.run(side_clients(port, seconds, hostile, schedule))


async def run_phase(
    phase: Phase,
    port: int,
    pid: int,
    seconds: float,
    valid: int,
    side: ProcessPoolExecutor,
    hostile: int = 0,
    schedule: list[Replay] | None = None,
) -> None:
    """`valid` closed-loop clients here, and in the side process either `hostile` hostile
    clients (their engine work recorded in `phase.replay`) or the replay of `schedule`."""
    phase.rss_start = rss(pid)
    stop = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=500, max_keepalive_connections=50)
    url = f"http://127.0.0.1:{port}"
    loop = asyncio.get_running_loop()
    others = None
    if hostile or schedule:
        others = loop.run_in_executor(side, side_process, port, seconds, hostile, schedule)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        await asyncio.gather(*(valid_client(client, phase, stop, i) for i in range(valid)))
    if others is not None:
        kinds, phase.replay = await others
        phase.kinds.update(kinds)
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
    valid, hostile_n = args.valid_clients, args.hostile_clients
    side = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    try:
        fill_pool(port, args.num_kv_blocks)
        warm = Phase("warm-up")  # the full mix: the allocator reaches its working size
        warm_seconds = min(30.0, seconds)
        asyncio.run(run_phase(warm, port, proc.pid, warm_seconds, valid, side, hostile_n))
        base = Phase("baseline")
        asyncio.run(run_phase(base, port, proc.pid, seconds, valid, side))
        hostile = Phase("hostile")
        asyncio.run(run_phase(hostile, port, proc.pid, seconds, valid, side, hostile_n))
        same = Phase("same work")
        asyncio.run(run_phase(same, port, proc.pid, seconds, valid, side, schedule=hostile.replay))
        alive = proc.poll() is None
    finally:
        side.shutdown()
        proc.terminate()
        proc.wait(30)
    print(
        f"machine: {machine_line()} at the end, Python "
        f"{platform.python_version()}; server --num-threads {args.threads}; "
        f"{args.valid_clients} valid + {args.hostile_clients} hostile clients, "
        f"{args.minutes:g} min per phase"
    )
    print(
        f"{'phase':10} {'valid req':>9} {'lost':>5} {'p50 s':>7} {'p99 s':>7} "
        f"{'RSS start MB':>12} {'RSS end MB':>10}"
    )
    for ph in (base, hostile, same):
        print(
            f"{ph.name:10} {ph.requests:9d} {ph.lost:5d} {pct(ph.latencies, 50):7.3f} "
            f"{pct(ph.latencies, 99):7.3f} {ph.rss_start / 2**20:12.1f} {ph.rss_end / 2**20:10.1f}"
        )
    print("hostile requests by kind (-> the status they got):")
    for kind, n in sorted(hostile.kinds.items()):
        print(f"  {kind:28} {n:6d}")
    p99 = {ph.name: pct(ph.latencies, 99) for ph in (base, hostile, same)}
    growth = max(hostile.rss_end, same.rss_end) / base.rss_start - 1
    print(
        f"engine work replayed in 'same work': {len(hostile.replay)} requests\n"
        f"p99 hostile / baseline: {p99['hostile'] / p99['baseline']:.2f} (target <= 1.2); "
        f"p99 hostile / same work: {p99['hostile'] / p99['same work']:.2f}; "
        f"same work / baseline: {p99['same work'] / p99['baseline']:.2f}\n"
        f"RSS growth after warm-up: {growth * 100:+.1f} % (target < 5 %); lost valid: "
        f"{base.lost + hostile.lost + same.lost} (target 0); server alive at the end: {alive}"
    )


if __name__ == "__main__":
    main()
