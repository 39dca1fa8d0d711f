"""The server's structured-output fields: OpenAI's `response_format`, vLLM's
`structured_outputs` and `guided_*`, through the official openai client against a real
server (the demo checkpoint); shapes and refusals also without one (structured.py)."""

from __future__ import annotations

import json
import re
from concurrent.futures import Future
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from kvserve.serve.http.errors import APIError
from kvserve.serve.request import structured
from kvserve.structured.compiler import Pending
from kvserve.structured.state import GrammarState

# Text no other test of the shared server sends (a cached prefix would change others).
CHAT = [{"role": "user", "content": "Describe a structured box."}]
PROMPT = "A structured answer:"
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "size": {"enum": ["small", "large"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "size", "count"],
    "additionalProperties": False,
}
JSON_SCHEMA = {
    "type": "json_schema",
    "json_schema": {"name": "box", "schema": SCHEMA, "strict": True},
}
REGEX = r"[a-c]{3}-[0-9]{2}"


def chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs = {"max_tokens": 64, "temperature": 0, **kwargs}
    return client.chat.completions.create(model=_model(client), messages=CHAT, **kwargs)


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def still_serving(client: openai.OpenAI) -> None:
    got = client.completions.create(model=_model(client), prompt=PROMPT, max_tokens=2)
    assert got.choices[0].text is not None


def test_json_schema_strict_validates(client):
    got = chat(client, response_format=JSON_SCHEMA)
    choice = got.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_json_object_is_an_object(client):
    got = chat(client, response_format={"type": "json_object"}, max_tokens=200)
    assert got.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(got.choices[0].message.content), dict)


def test_text_format_is_no_constraint(client):
    plain = chat(client, max_tokens=6)
    text = chat(client, max_tokens=6, response_format={"type": "text"})
    assert text.choices[0].message.content == plain.choices[0].message.content


def test_completions_regex_and_choice(client):
    model = _model(client)
    got = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=32,
        temperature=0,
        n=2,
        extra_body={"structured_outputs": {"regex": REGEX}},
    )
    assert all(re.fullmatch(REGEX, c.text) for c in got.choices), got.choices
    choices = ["red", "green", "blue"]
    got = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=8,
        temperature=1.0,
        seed=3,
        extra_body={"guided_choice": choices},
    )
    assert got.choices[0].text in choices


def test_guided_json_and_structured_json_on_completions(client):
    for extra in ({"guided_json": SCHEMA}, {"structured_outputs": {"json": SCHEMA}}):
        got = client.completions.create(
            model=_model(client), prompt=PROMPT, max_tokens=64, temperature=0, extra_body=extra
        )
        jsonschema.validate(json.loads(got.choices[0].text), SCHEMA)


def test_streamed_json_schema_chat_parses(client):
    stream = chat(client, response_format=JSON_SCHEMA, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert text == chat(client, response_format=JSON_SCHEMA).choices[0].message.content


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "bad", "schema": {"type": "nonsense"}},
                }
            },
            "response_format",
            "nonsense",
        ),
        ({"guided_regex": "(["}, "guided_regex", "Unclosed"),
        ({"structured_outputs": {"regex": "(["}}, "structured_outputs", "Unclosed"),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a+"},
            "guided_regex",
            "response_format and guided_regex",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "schema",
        ),
        ({"guided_choice": ["a", 1]}, "guided_choice", "guided_choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "one"),
        ({"structured_outputs": {"whitespace": "x"}}, "structured_outputs", "whitespace"),
        ({"response_format": {"type": "yaml"}}, "response_format", "yaml"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_bad_constraints_are_a_400_naming_the_field(client, extra, param, says, stream):
    with pytest.raises(openai.BadRequestError) as caught:
        if stream:
            list(chat(client, stream=True, extra_body=extra))
        else:
            chat(client, extra_body=extra)
    error = caught.value.body
    assert caught.value.status_code == 400
    assert error["param"] == param and says in error["message"], error
    still_serving(client)


def test_the_error_body_is_openais(server):
    body = {"prompt": PROMPT, "max_tokens": 2, "guided_regex": "(["}
    resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == "guided_regex"


# -- without a server -----------------------------------------------------------------


def test_all_null_and_text_ask_for_nothing():
    body = {"response_format": {"type": "text"}, "guided_json": None, "structured_outputs": {}}
    assert structured.structured_outputs(body) is None
    assert structured.structured_outputs({"structured_outputs": {"json_object": False}}) is None


def test_each_spelling_reads_as_the_engine_constraint():
    found = structured.structured_outputs({"response_format": JSON_SCHEMA})
    assert found is not None and found[0].json == SCHEMA and found[1] == "response_format"
    found = structured.structured_outputs({"guided_grammar": 'root ::= "a"'})
    assert found is not None and found[0].grammar == 'root ::= "a"'
    found = structured.structured_outputs({"structured_outputs": {"json_object": True}})
    assert found is not None and found[0].json_object is True


def test_a_compile_that_fails_later_is_a_400_for_its_request():
    future: Future[Any] = Future()
    future.set_exception(RuntimeError("[12:00:00] x.cc:1: boom"))
    with pytest.raises(ValueError, match=r"^structured_outputs: the grammar failed") as caught:
        _ = GrammarState(Pending(("json", "{}"), future)).matcher
    error = f"ValueError: {caught.value}"
    failed = structured.compile_failure(error, "guided_json")
    assert isinstance(failed, APIError) and failed.status == 400
    assert failed.param == "guided_json" and "boom" in failed.message
    assert structured.compile_failure("RuntimeError: other", "guided_json") is None
    assert structured.compile_failure(error, None) is None
