"""Connections hold nothing for long (issue 26): silent, slow and non-reading clients are
timed out, and none keeps KV blocks after it goes; a client that leaves while sending its
body costs one log line, not a traceback."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.serve.conftest import metric, scrape, start_server, stop_server

LIMITS = [
    "--header-timeout=1",
    "--body-timeout=2",
    "--keep-alive-timeout=1",
    "--send-timeout=1",
    "--max-request-bytes=200000",
]


@pytest.fixture(scope="module")
def strict(demo):
    srv = start_server(demo, *LIMITS)
    yield srv
    if srv.proc.poll() is None:
        stop_server(srv)


def connect(server) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def closed_within(sock: socket.socket, seconds: float) -> float:
    """Seconds until the server closed the connection (reading whatever it sent)."""
    started = time.monotonic()
    sock.settimeout(seconds)
    while True:
        try:
            if not sock.recv(65536):
                return time.monotonic() - started
        except ConnectionResetError:
            return time.monotonic() - started


def test_a_silent_connection_is_closed(strict):
    with connect(strict) as sock:
        assert closed_within(sock, 5) < 3


def test_headers_sent_a_byte_at_a_time_are_cut_off(strict):
    with connect(strict) as sock:
        started = time.monotonic()
        for byte in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n":
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break
            time.sleep(0.1)
            if time.monotonic() - started > 4:
                break
        assert closed_within(sock, 5) + (time.monotonic() - started) < 6


def test_an_idle_keep_alive_connection_is_closed(strict):
    with connect(strict) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        assert closed_within(sock, 5) < 3


def test_a_body_that_never_finishes_is_a_408(strict):
    with connect(strict) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"prompt": '
        )
        sock.settimeout(6)
        answer = sock.recv(65536)
        while b"\r\n\r\n" not in answer or answer.endswith(b"\r\n\r\n"):
            more = sock.recv(65536)  # headers and body may come in two segments
            if not more:
                break
            answer += more
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert "--body-timeout" in body["error"]["message"]


def test_a_declared_body_past_the_limit_is_refused_unread(strict):
    with connect(strict) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 999999999\r\n\r\n"
        )
        sock.settimeout(5)
        assert sock.recv(65536).startswith(b"HTTP/1.1 413")


def test_clients_leaving_mid_body_log_one_line_not_tracebacks(strict):
    for _ in range(30):
        with connect(strict) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n{"
            )
            time.sleep(0.01)
    time.sleep(0.5)
    assert httpx.get(f"{strict.url}/health", timeout=10).status_code == 200


def test_a_client_that_never_reads_its_stream_is_dropped_and_frees_its_blocks(strict):
    idle = metric(scrape(strict), "kvserve:kv_cache_usage_perc")
    body = {
        "prompt": "hi",
        "max_tokens": 1500,
        "ignore_eos": True,
        "n": 8,
        "logprobs": 20,
        "stream": True,
    }
    raw = json.dumps(body).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    host, port = strict.url.removeprefix("http://").split(":")
    sock.connect((host, int(port)))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(raw)}\r\n\r\n".encode()
        + raw
    )
    try:
        deadline = time.monotonic() + 30
        values = scrape(strict)
        while time.monotonic() < deadline:
            values = scrape(strict)
            running = metric(values, "kvserve:num_requests_running")
            if running == 0 and metric(values, "kvserve:kv_cache_usage_perc") == idle:
                break
            time.sleep(0.2)
        assert metric(values, "kvserve:num_requests_running") == 0
        assert metric(values, "kvserve:kv_cache_usage_perc") == idle
    finally:
        sock.close()


def test_the_log_has_no_tracebacks(strict):
    """Last in this file: the strict server's log, read once it stopped."""
    log = stop_server(strict)
    assert "Traceback" not in log, log[-3000:]
    assert "dropped a client that read nothing" in log
    assert log.count("left while sending its request") <= 2
