"""What a client can make the server keep, and JSON hidden inside strings, against a real server.

/v1/responses keeps a response as sent: its `metadata` and identifiers are held to OpenAI's
bounds (a 500,000-key metadata is a 400, not 61 MB kept), and the store is bounded by bytes
(`--responses-store-mb`: the oldest go first) as well as by count; with the one API key
every holder reads the same store, and nobody else reads any of it. A tool call's
`arguments` (a JSON string) nested 100,000 deep is a 400 naming it, in chat, the Responses
API and the Messages API alike, and the server keeps serving. A client that leaves a
response early has it aborted.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.serve.conftest import metric, scrape, start_server, stop_server
from tests.serve.test_batch_admission import send_and_leave

KEY = {"Authorization": "Bearer k"}
STORE_MB = 0.05
DEEP = "[" * 100_000 + "]" * 100_000


@pytest.fixture(scope="module")
def keyed(demo):
    server = start_server(demo, "--api-key", "k", "--responses-store-mb", str(STORE_MB))
    yield server
    stop_server(server)


def post(server, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=headers or KEY, timeout=60)


def refused(resp: httpx.Response, param: str | None) -> str:
    assert resp.status_code == 400, resp.text[:300]
    error = resp.json()["error"]
    assert error["param"] == param, error
    return str(error["message"])


def respond(server, **extra) -> httpx.Response:
    body = {"input": "Say hi.", "max_output_tokens": 2, "temperature": 0, **extra}
    return post(server, "/v1/responses", body)


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"metadata": {f"k{i}": "v" for i in range(500_000)}}, "metadata", "at most 16"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "at most 16"),
        ({"metadata": {"k" * 65: "v"}}, "metadata", "64 characters"),
        ({"metadata": {"k": "v" * 513}}, "metadata", "512"),
        ({"metadata": {"k": {"nested": "object"}}}, "metadata", "string"),
        ({"metadata": ["not", "an", "object"]}, "metadata", "object"),
        ({"user": "u" * 65}, "user", "64 characters"),
        ({"safety_identifier": "s" * 65}, "safety_identifier", "64 characters"),
    ],
    ids=["500k-keys", "17-pairs", "long-key", "long-value", "object-value", "list", "user", "sid"],
)
def test_kept_fields_are_held_to_openais_bounds(keyed, extra, param, words):
    assert words in refused(respond(keyed, **extra), param)


@pytest.mark.slow
def test_refused_metadata_leaves_no_memory_behind(keyed):
    """Five 500,000-key bodies (each ~61 MB if it were kept): memory stays near its start."""
    with open(f"/proc/{keyed.proc.pid}/status") as status:
        before = next(int(x.split()[1]) for x in status if x.startswith("VmRSS:"))
    huge = {f"k{i}": "v" for i in range(500_000)}
    for _ in range(5):
        assert respond(keyed, metadata=huge).status_code == 400
    with open(f"/proc/{keyed.proc.pid}/status") as status:
        after = next(int(x.split()[1]) for x in status if x.startswith("VmRSS:"))
    assert (after - before) / 1024 < 150, f"{(after - before) / 1024:.0f} MB more"


def test_the_bounds_themselves_are_accepted_and_kept(keyed):
    metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    made = respond(keyed, metadata=metadata, user="u" * 64)
    assert made.status_code == 200, made.text[:300]
    got = httpx.get(f"{keyed.url}/v1/responses/{made.json()['id']}", headers=KEY, timeout=30)
    assert got.json()["metadata"] == metadata and got.json()["user"] == "u" * 64


def test_the_store_is_bounded_by_bytes_oldest_first(keyed):
    """Responses of ~9 KB each in a store of 50 KB: the newest are kept, the oldest gone."""
    metadata = {f"{i:02d}": "m" * 512 for i in range(16)}
    ids = []
    for i in range(12):
        made = respond(keyed, metadata=metadata, input=f"Response {i}: " + "word " * 100)
        assert made.status_code == 200, made.text[:300]
        ids.append(made.json()["id"])
    kept = [
        httpx.get(f"{keyed.url}/v1/responses/{i}", headers=KEY, timeout=30).status_code == 200
        for i in ids
    ]
    assert kept[-1] and not kept[0], kept
    assert sum(kept) <= int(STORE_MB * 2**20) // (16 * 512), kept  # a count alone keeps all 12
    assert kept == sorted(kept), kept  # oldest first


def test_the_one_key_owns_the_store(keyed):
    """One key per server: a stored response is every key holder's, and nobody else's."""
    made = respond(keyed)
    assert made.status_code == 200, made.text[:300]
    url = f"{keyed.url}/v1/responses/{made.json()['id']}"
    for headers in ({}, {"Authorization": "Bearer other"}):
        assert httpx.get(url, headers=headers, timeout=30).status_code == 401
        assert httpx.delete(url, headers=headers, timeout=30).status_code == 401
    assert httpx.get(url, headers=KEY, timeout=30).status_code == 200
    assert httpx.delete(url, headers=KEY, timeout=30).status_code == 200
    assert httpx.get(url, headers=KEY, timeout=30).status_code == 404


def test_deep_tool_call_arguments_are_a_400_naming_them(keyed):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP}}
    chat = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "done"},
        ],
        "max_tokens": 2,
    }
    message = refused(post(keyed, "/v1/chat/completions", chat), "messages")
    assert "messages[1].tool_calls[0].function.arguments nests deeper than 32" in message

    items = [
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": DEEP},
        {"type": "function_call_output", "call_id": "c1", "output": "done"},
    ]
    message = refused(respond(keyed, input=items), "input")
    assert "function.arguments nests deeper than 32" in message

    # Anthropic's tool_use input is an object in the body: the body's own depth bound.
    deep_input = b'{"a":' * 100_000 + b"1" + b"}" * 100_000
    content = (
        b'{"model": "m", "max_tokens": 2, "messages": [{"role": "assistant", "content": '
        b'[{"type": "tool_use", "id": "t", "name": "f", "input": ' + deep_input + b"}]}]}"
    )
    resp = httpx.post(
        f"{keyed.url}/v1/messages",
        content=content,
        headers={**KEY, "content-type": "application/json"},
        timeout=60,
    )
    assert resp.status_code == 400, resp.text[:300]
    assert resp.json()["type"] == "error" and "deeper than 32" in resp.json()["error"]["message"]

    alive = post(keyed, "/v1/chat/completions", {"messages": chat["messages"][:1], "max_tokens": 2})
    assert alive.status_code == 200, alive.text[:300]


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_responses_client_that_leaves_has_its_request_aborted(keyed, stream):
    """Gone after the first event (streamed) or while waiting (whole): the engine aborts it
    (the abort is counted, nothing keeps running) and nothing is stored for nobody."""
    aborted = metric(scrape(keyed), "kvserve:request_success_total", finished_reason="abort")
    body = {"input": "Tell a long story.", "max_output_tokens": 1500, "stream": stream}
    url = f"{keyed.url}/v1/responses"
    if stream:
        with httpx.stream("POST", url, json=body, headers=KEY, timeout=60) as resp:
            assert resp.status_code == 200
            next(resp.iter_lines())
    else:  # gone once the engine has it (a client timeout could fire before a busy server
        # had read the request: then there is nothing to abort)
        send_and_leave(keyed, "/v1/responses", body, queued=True, key="k")

    def settled() -> bool:
        values = scrape(keyed)
        gone = metric(values, "kvserve:request_success_total", finished_reason="abort")
        return gone > aborted and metric(values, "kvserve:num_requests_running") == 0

    deadline = time.monotonic() + 30
    while not settled():
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.2)
    assert respond(keyed).status_code == 200


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_json": DEEP}, "guided_json"),
        ({"structured_outputs": {"json": DEEP}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": DEEP}}, "structured_outputs"),
    ],
    ids=["guided_json", "structured_outputs.json", "structural_tag"],
)
def test_a_deep_schema_in_a_string_is_a_400_naming_it(keyed, extra, param):
    body = {"prompt": "hi", "max_tokens": 2, **extra}
    assert "nests deeper than 32" in refused(post(keyed, "/v1/completions", body), param)
    assert post(keyed, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200
