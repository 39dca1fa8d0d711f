"""`kvserve route` under careless and hostile clients and replicas that refuse.

Its own answers are OpenAI's error bodies (404, 405, 413, its "no replica" 503 with
Retry-After); its /version is serve's, behind the same key; a body over
--max-request-bytes is refused before it is read whole; a relayed header is bounded; a
draining replica's 503 is retried elsewhere and the replica gets nothing new; a client
that leaves before a non-streamed answer has its request aborted on the replica; a client
that leaves while sending its body is one log line, on the router and on serve alike.
"""

from __future__ import annotations

import signal
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from tests.router._standin import StandIn
from tests.router.conftest import (
    router_value,
    start_replica,
    start_replicas,
    start_router,
    stop_all,
    wait_for,
)
from tests.serve.conftest import metric, scrape, wait_healthy

KEY = {"Authorization": "Bearer k"}
LIMIT = 64_000


@pytest.fixture(scope="module")
def replica(demo):
    (server,) = start_replicas(demo, 1)
    yield server
    stop_all(server)


def assert_openai_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    return body["error"]


def test_the_routers_own_answers_headers_and_limits(replica):
    router = start_router([replica], "--api-key", "k", "--max-request-bytes", str(LIMIT))
    try:
        url = router.url
        assert_openai_error(httpx.get(f"{url}/no/such/route", headers=KEY), 404)
        wrong = httpx.get(f"{url}/v1/completions", headers=KEY)
        assert "not allowed" in assert_openai_error(wrong, 405)["message"]
        assert "POST" in wrong.headers["allow"]

        assert_openai_error(httpx.get(f"{url}/version"), 401)  # behind the key, as on serve
        version = httpx.get(f"{url}/version", headers=KEY)
        assert version.json() == httpx.get(f"{replica.url}/version").json()
        assert set(version.json()) == {"version"}

        big = {"model": replica.model, "prompt": "x" * LIMIT}
        refused = httpx.post(f"{url}/v1/completions", json=big, headers=KEY, timeout=30)
        error = assert_openai_error(refused, 413)
        assert str(LIMIT) in error["message"] and "--max-request-bytes" in error["message"]

        def chunked():  # no Content-Length: refused once it passes the bound
            for _ in range(20):
                yield b"[" * 8192

        refused = httpx.post(f"{url}/tokenize", content=chunked(), headers=KEY, timeout=30)
        assert_openai_error(refused, 413)

        # A header the replica builds from client input is relayed bounded.
        name = "f" * 20_000
        body = {"model": replica.model, "prompt": "hi", "max_tokens": 1, name: 1, "g": 2}
        resp = httpx.post(f"{url}/v1/completions", json=body, headers=KEY, timeout=30)
        assert resp.status_code == 200, resp.text
        direct = httpx.post(f"{replica.url}/v1/completions", json=body, timeout=30)
        full = direct.headers.get("x-kvserve-ignored-fields", "")
        relayed = resp.headers.get("x-kvserve-ignored-fields", "")
        assert len(relayed) <= 4096
        if len(full) <= 4096:  # the replica bounded it itself
            assert relayed == full
        else:
            assert relayed.endswith(",...") and full.startswith(relayed[: -len(",...")])
    finally:
        stop_all(router)


def test_no_replica_is_a_503_with_retry_after(replica):
    info = httpx.get(f"{replica.url}/kv-metadata", timeout=10).json()
    broken = StandIn({**info, "kv_events": None})
    router = None
    try:
        router = start_router([broken], "--health-interval", "30")
        resp = httpx.post(f"{router.url}/v1/completions", json={"prompt": "hi"}, timeout=30)
        assert "no replica" in assert_openai_error(resp, 503)["message"]
        assert resp.headers["retry-after"] == "1"
    finally:
        stop_all(router)
        broken.close()


@pytest.mark.slow
def test_a_draining_replicas_503_goes_elsewhere_and_it_gets_nothing_new(demo):
    draining = start_replica(demo, wait=False)
    (other,) = start_replicas(demo, 1)
    router = None
    try:
        wait_healthy(draining)
        router = start_router(
            [draining, other], "--policy", "round-robin", "--health-interval", "30"
        )
        # A long request keeps it draining after SIGTERM (it finishes its work first).
        long = {"model": demo, "prompt": "on", "max_tokens": 2000, "n": 2, "ignore_eos": True}
        with httpx.stream(
            "POST", f"{draining.url}/v1/completions", json={**long, "stream": True}, timeout=60
        ) as held:
            next(held.iter_lines())
            draining.proc.send_signal(signal.SIGTERM)
            wait_for(lambda: httpx.get(f"{draining.url}/health").status_code == 503)
            for i in range(4):
                body = {"model": demo, "prompt": f"request {i}", "max_tokens": 2}
                resp = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
                assert resp.status_code == 200, resp.text
            assert router_value(router, "requests_total", draining) == 1  # then no more
            assert router_value(router, "retries_total", draining) == 1
            assert router_value(router, "requests_total", other) == 4  # each one
            assert httpx.get(f"{router.url}/health").status_code == 200
    finally:
        if draining.proc.poll() is None:
            draining.proc.kill()
        stop_all(router, other, draining)


@pytest.mark.slow
def test_a_client_that_leaves_has_its_request_aborted_on_the_replica(replica):
    router = start_router([replica])
    try:
        before = scrape(replica)
        body = {"model": replica.model, "prompt": "go", "max_tokens": 2000, "n": 4}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{router.url}/v1/completions", json={**body, "ignore_eos": True},
                       timeout=httpx.Timeout(60, read=1.5))  # fmt: skip
        left = time.monotonic()
        running = "kvserve:num_requests_running"
        wait_for(lambda: metric(scrape(replica), running) == 0, timeout=10, what="the abort")
        assert time.monotonic() - left < 6  # not the ~20 s the request would run
        name = "kvserve:request_success_total"
        after = scrape(replica)
        delta = metric(after, name, finished_reason="abort") - metric(
            before, name, finished_reason="abort"
        )
        assert delta == 4  # its n completions
    finally:
        stop_all(router)


def send_half_a_body(url: str, times: int) -> None:
    """`times` clients that promise a body, send a bit of it and leave."""
    parts = urlsplit(url)
    for _ in range(times):
        with socket.create_connection((parts.hostname, parts.port), timeout=5) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: 100000\r\n\r\n" + b'{"prompt": "' + b"a" * 1000
            )
            time.sleep(0.05)


@pytest.mark.slow
def test_clients_that_leave_mid_body_are_one_line_not_tracebacks(demo):
    server = start_replica(demo)
    router = start_router([server])
    try:
        for target in (router, server):
            send_half_a_body(target.url, 30)
        time.sleep(0.5)
        body = {"prompt": "hi", "max_tokens": 1}
        ok = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
        assert ok.status_code == 200  # nothing else was hurt
    finally:
        router_out, server_out = stop_all(router, server)
    for out in (router_out, server_out):
        assert "Traceback" not in out and "Exception in ASGI" not in out, out[-3000:]
        lines = [line for line in out.splitlines() if "left while sending" in line]
        assert 1 <= len(lines) <= 2, out[-3000:]


def test_router_takes_every_body_a_replica_takes():
    """The router's default body limit is the server's: a request serve accepts passes it."""
    from kvserve.router.limits import MAX_REQUEST_BYTES
    from kvserve.serve.http.limits import ServeLimits

    assert ServeLimits().max_request_bytes == MAX_REQUEST_BYTES
