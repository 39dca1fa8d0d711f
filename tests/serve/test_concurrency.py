"""64 streaming clients at once (issue 26): some leave mid-stream, some never read, and a
burst of invalid requests comes with them. Every valid request gets the greedy answer it
gets alone, and /metrics is back to idle (nothing running, KV usage as before) within a
second after."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx

from tests.serve.conftest import metric, scrape

PROMPTS = ["The cache", "A block of", "Prefix sharing", "Hello there"]
CLIENTS = 64
MAX_TOKENS = 8


def body(i: int, stream: bool = True) -> dict:
    return {
        "prompt": PROMPTS[i % len(PROMPTS)],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


async def streamed_text(client: httpx.AsyncClient, i: int) -> str:
    text = []
    async with client.stream("POST", "/v1/completions", json=body(i)) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text)


async def leaves_mid_stream(client: httpx.AsyncClient, i: int) -> None:
    big = {**body(i), "max_tokens": 400}
    async with client.stream("POST", "/v1/completions", json=big) as resp:
        async for _ in resp.aiter_lines():
            break  # closes the connection with the stream half read


def never_reads(url: str, i: int) -> socket.socket:
    raw = json.dumps({**body(i), "max_tokens": 400}).encode()
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(raw)}\r\n\r\n".encode()
        + raw
    )
    return sock


INVALID = [
    {"prompt": "hi", "seed": 2**64, "temperature": 1.0},
    {"prompt": "hi", "top_k": 2**63, "top_p": 0.5},
    {"prompt": "hi", "n": 10**9},
    {"prompt": [10**9]},
    {"prompt": "hi", "stream": "yes"},
    {"messages": [{"role": "nobody", "content": "x"}]},
]


async def invalid(client: httpx.AsyncClient, i: int) -> int:
    payload = INVALID[i % len(INVALID)]
    path = "/v1/chat/completions" if "messages" in payload else "/v1/completions"
    resp = await client.post(path, json=payload)
    assert resp.status_code == 400 and "error" in resp.json(), resp.text
    return resp.status_code


def test_many_clients_good_and_bad_leave_the_server_as_it_was(server):
    alone = []
    for i in range(len(PROMPTS)):
        resp = httpx.post(f"{server.url}/v1/completions", json=body(i, False), timeout=60)
        alone.append(resp.json()["choices"][0]["text"])
    idle = metric(scrape(server), "kvserve:kv_cache_usage_perc")

    async def main() -> list[str]:
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            valid = [streamed_text(client, i) for i in range(CLIENTS)]
            leaving = [leaves_mid_stream(client, i) for i in range(8)]
            bad = [invalid(client, i) for i in range(24)]
            results = await asyncio.gather(*valid, *leaving, *bad)
        return results[:CLIENTS]

    sockets = [never_reads(server.url, i) for i in range(4)]
    try:
        texts = asyncio.run(main())
    finally:
        for sock in sockets:
            sock.close()
    assert texts == [alone[i % len(PROMPTS)] for i in range(CLIENTS)]
    deadline = time.monotonic() + 1.0 + 0.5  # one second, plus the scrape's own time
    while True:
        values = scrape(server)
        running = metric(values, "kvserve:num_requests_running")
        usage = metric(values, "kvserve:kv_cache_usage_perc")
        if (running, usage) == (0, idle) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert (running, usage) == (0, idle)
