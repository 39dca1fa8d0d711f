"""Constraints a hostile client sends, against a real server: sizes past the limits are
400s naming the field and the option, answered before any compile (a compile of what they
send would take minutes); a malformed one (text that is not JSON, the wrong shape) is a 400
naming its field; a grammar that accepts nothing is a 400; a huge in-limit enum
whose client leaves does not hold another client's small `guided_choice`, and one past
--grammar-compile-timeout is a 400 naming it (`tool_choice: required` included)."""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import anthropic
import httpx
import openai
import pytest
import xgrammar

from kvserve.serve.http.limits import ServeLimits
from tests.serve.conftest import metric, scrape, start_server, stop_server
from tests.serve.test_errors import error_of, still_serves
from tests.serve.test_tool_calls import ASK, TOOLS

LIMITS = ServeLimits()
try:  # xgrammar 0.2.9 refuses a schema that only refers to itself when it builds it
    xgrammar.Grammar.from_json_schema('{"$ref": "#"}')
    SELF_REF = ""  # older ones build a grammar that accepts nothing (a dead end)
except RuntimeError:
    SELF_REF = "Circular $ref"
SELF_REF_SCHEMA: dict[str, Any] = {"$ref": "#"}
"""A schema with no value: a 400 before any token either way, in xgrammar's words or ours."""
CHAT = [{"role": "user", "content": "Pick a structured word."}]
SMALL = ["alpha", "beta", "gamma"]


def enum(n: int, tag: str = "v") -> dict[str, Any]:
    return {"type": "string", "enum": [f"{tag}-{i:06d}-value" for i in range(n)]}


def post(url: str, body: dict[str, Any], timeout: float = 60) -> httpx.Response:
    body = {"messages": CHAT, "max_tokens": 8, "temperature": 0, **body}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=timeout)


def refused(response: httpx.Response, param: str, *says: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    for text in says:
        assert text in error["message"], error["message"]


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"guided_choice": [f"c{i}" for i in range(LIMITS.max_grammar_values + 1)]},
         "guided_choice", ["--max-grammar-values", str(LIMITS.max_grammar_values)]),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "big", "schema": {"type": "object", "properties": {
                "a": enum(3000, "a"), "b": enum(3000, "b")}}}}},
         "response_format", ["6000 enum", "--max-grammar-values"]),
        ({"guided_json": enum(100_000)}, "guided_json", ["--max-grammar-bytes"]),
        ({"structured_outputs": {"regex": "(a|b)" * 60_000}},
         "structured_outputs", ["--max-grammar-bytes", str(LIMITS.max_grammar_bytes)]),
    ],
    ids=["choices", "schema-values", "schema-bytes", "regex-bytes"],
)  # fmt: skip
def test_an_oversized_constraint_is_a_400_before_any_compile(server, body, param, says):
    started = time.monotonic()
    refused(post(server.url, body), param, *says)
    assert time.monotonic() - started < 5  # compiling it would take minutes
    assert post(server.url, {"guided_choice": SMALL}).status_code == 200


@pytest.mark.parametrize("field", ["guided_json", "response_format"])
def test_a_schema_that_accepts_nothing_is_a_400(server, field):
    schema = SELF_REF_SCHEMA
    body = (
        {field: schema}
        if field == "guided_json"
        else {field: {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    )
    before = computed(server)
    says = SELF_REF or "accepts no output"
    refused(post(server.url, body), field, says)
    stream = post(server.url, {**body, "stream": True})
    refused(stream, field, says)  # before the stream starts
    assert computed(server) == before  # failed before its prefill: no token computed


def computed(server: Any) -> float:
    """Tokens the engine computed (prefill and decode), all steps together."""
    return metric(scrape(server), "kvserve:iteration_tokens_total_sum")


TAG = {"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"structured_outputs": {"structural_tag": "not json"}},
         "structured_outputs", "structured_outputs.structural_tag is not valid JSON"),
        ({"structured_outputs": {"structural_tag": "[" * 40 + "]" * 40}},
         "structured_outputs", "nests deeper than 32"),
        ({"structured_outputs": {"structural_tag": [TAG]}},
         "structured_outputs", "structural_tag must be a dict or a string"),
        ({"structured_outputs": {"structural_tag": 7}},
         "structured_outputs", "structural_tag must be a dict or a string"),
        ({"structured_outputs": {"structural_tag": "[1, 2]"}},
         "structured_outputs", "structural_tag must be an object with a format"),
        ({"structured_outputs": {"structural_tag": {"type": "structural_tag"}}},
         "structured_outputs", "structural_tag must be an object with a format"),
        ({"structured_outputs": {"json": "{not json"}},
         "structured_outputs", "structured_outputs.json is not valid JSON"),
        ({"guided_json": "not json"}, "guided_json", "guided_json is not valid JSON"),
        ({"guided_json": "[1]"}, "guided_json", "guided_json must be a JSON schema"),
        ({"guided_json": '{"a": ' * 40 + "1" + "}" * 40}, "guided_json", "nests deeper than 32"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": '{"type": "object"}'}}},
         "response_format", "response_format.json_schema.schema must be a JSON schema"),
    ],
    ids=["tag-not-json", "tag-deep", "tag-list", "tag-number", "tag-json-list", "tag-no-format",
         "json-not-json", "guided-not-json", "guided-list", "guided-deep", "schema-string"],
)  # fmt: skip
@pytest.mark.parametrize("path", ["chat", "completions"])
def test_a_malformed_constraint_is_a_400_naming_its_field(server, body, param, says, path):
    """Found by the fuzz test: a structural tag that is not JSON was a 500 (the size check
    read it unguarded); every other spelling of a malformed constraint is the same 400."""
    if path == "chat":
        response = post(server.url, body)
    else:
        full = {"model": server.model, "prompt": "hi", "max_tokens": 4, **body}
        response = httpx.post(f"{server.url}/v1/completions", json=full, timeout=60)
    error = error_of(response, 400)
    assert error["param"] == param and says in error["message"], error
    still_serves(server)


def test_a_structural_tag_without_format_beside_tools_is_a_400(tool_server):
    """Composed with `auto` tools (its format is the answer without calls): read safely."""
    body = {"messages": ASK, "tools": TOOLS, "structured_outputs": {"structural_tag": "{}"}}
    refused(post(tool_server.url, body), "structured_outputs", "must be an object with a format")
    ok = {"messages": ASK, "tools": TOOLS, "structured_outputs": {"structural_tag": TAG}}
    assert post(tool_server.url, ok).status_code == 200


def test_a_dead_end_after_the_first_token_is_a_400_not_a_500(tool_server):
    """The grammar starts (the call's marker) but its arguments' schema has no value."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": SELF_REF_SCHEMA}}]
    body = {"messages": ASK, "tools": tools, "tool_choice": "required", "max_tokens": 60}
    says = SELF_REF or "dead end"  # xgrammar 0.2.9: refused as it builds, before any token
    refused(post(tool_server.url, body), "tools", says)
    events = post(tool_server.url, {**body, "stream": True}).text
    # a dead end mid-stream is an error event; a schema refused as it builds, a 400 before it
    assert '"type":"invalid_request_error","param":"tools"' in events.replace(" ", "")
    assert says in events
    endless = {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "required": ["a"]}
    endless["$defs"] = {"x": {"$ref": "#/$defs/x"}}
    refused(post(tool_server.url, {"guided_json": endless}), "guided_json", says)
    claude = anthropic.Anthropic(base_url=tool_server.url, api_key="unused", timeout=30)
    with claude, pytest.raises(anthropic.BadRequestError, match=re.escape(says)):
        claude.messages.create(
            model="demo-tools", max_tokens=60, messages=ASK,
            tools=[{"name": "f", "input_schema": SELF_REF_SCHEMA}], tool_choice={"type": "any"},
        )  # fmt: skip


def test_too_many_tools_is_a_400_on_every_api(tool_server):
    many = [
        {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
        for i in range(LIMITS.max_tools + 1)
    ]
    body = {"messages": ASK, "tools": many, "tool_choice": "required"}
    refused(post(tool_server.url, body), "tools", "--max-tools", str(LIMITS.max_tools))
    big = [{"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"x": enum(LIMITS.max_grammar_values + 1)}}}}]  # fmt: skip
    refused(post(tool_server.url, {"messages": ASK, "tools": big}), "tools", "--max-grammar")
    with openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key="unused", timeout=30) as c:
        flat = [{**t["function"], "type": "function"} for t in many]
        with pytest.raises(openai.BadRequestError, match="--max-tools"):
            c.responses.create(model="demo-tools", input="hi", tools=flat, max_output_tokens=4)
        fmt = {"type": "json_schema", "name": "big", "schema": enum(LIMITS.max_grammar_values + 1)}
        with pytest.raises(openai.BadRequestError, match="--max-grammar-values"):
            c.responses.create(model="demo-tools", input="hi", text={"format": fmt})
    with anthropic.Anthropic(base_url=tool_server.url, api_key="unused", timeout=30) as a:
        tools = [{"name": t["name"], "input_schema": t["parameters"]} for t in flat]
        with pytest.raises(anthropic.BadRequestError, match="--max-tools"):
            a.messages.create(model="demo-tools", max_tokens=4, tools=tools, messages=ASK)


def aborted(server: Any) -> float:
    return metric(scrape(server), "kvserve:request_success_total", finished_reason="abort")


@pytest.fixture(scope="module")
def slow_compiles(demo) -> Any:
    """The demo checkpoint (its template shows no tools: the prompt stays short) with
    limits a 30,000-value enum fits (about 7 s to compile on the demo tokenizer) and a
    compile deadline shorter than that."""
    srv = start_server(
        demo, "--max-grammar-values", "40000", "--max-grammar-bytes", "4000000",
        "--grammar-compile-timeout", "3",
    )  # fmt: skip
    yield srv
    print(stop_server(srv)[-3000:])


@pytest.mark.slow
def test_a_slow_compile_never_holds_another_clients_request(slow_compiles):
    url = slow_compiles.url

    def huge_then_leave() -> None:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up after 1.5 s
            post(url, {"guided_json": enum(30_000, "left")}, timeout=1.5)

    leaver = threading.Thread(target=huge_then_leave)
    leaver.start()
    time.sleep(0.5)  # its compile is under way
    started = time.monotonic()
    meanwhile = post(url, {"guided_choice": SMALL}, timeout=30)
    assert meanwhile.status_code == 200 and time.monotonic() - started < 5
    leaver.join()
    deadline = time.monotonic() + 10
    while aborted(slow_compiles) < 1:  # the leaver's request was aborted while it compiled
        assert time.monotonic() < deadline, "the request of the client that left ran on"
        time.sleep(0.2)
    text = meanwhile.json()["choices"][0]["message"]["content"]
    assert text in SMALL
    parameters = {"type": "object", "properties": {"x": enum(30_000, "tool")}, "required": ["x"]}
    tools = [{"type": "function", "function": {"name": "pick", "parameters": parameters}}]
    late: list[httpx.Response] = []
    forced = threading.Thread(
        target=lambda: late.append(
            post(url, {"messages": ASK, "tools": tools, "tool_choice": "required"})
        )
    )
    forced.start()
    time.sleep(0.5)
    started = time.monotonic()
    again = post(url, {"guided_choice": SMALL}, timeout=30)
    assert again.status_code == 200 and time.monotonic() - started < 5
    assert again.json()["choices"][0]["message"]["content"] == text  # as before, alone
    forced.join(timeout=60)
    refused(late[0], "tools", "did not compile within 3s", "--grammar-compile-timeout")
    assert post(url, TOOLS_BODY).status_code == 200  # the server goes on


@pytest.mark.slow
def test_a_compile_past_its_deadline_is_a_400_before_any_prefill(slow_compiles):
    """The answer names the option; the request never took a prefill step (nor blocks)."""
    before = computed(slow_compiles)
    for stream in (False, True):
        body = {"guided_json": enum(30_000, f"late{stream}"), "stream": stream}
        says = ("did not compile within 3s", "--grammar-compile-timeout")
        refused(post(slow_compiles.url, body), "guided_json", *says)
    assert computed(slow_compiles) == before
    assert post(slow_compiles.url, {"guided_choice": SMALL}).status_code == 200


TOOLS_BODY = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 4}
