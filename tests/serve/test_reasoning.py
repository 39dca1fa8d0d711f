"""`--reasoning-parser qwen3` end to end (issue 30, item 2): a tiny Qwen3 whose greedy answer
is `<think>` REASONING `</think>` CONTENT (tests/serve/_thinking_model.py), served, and
read with the openai client whole and streamed."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.serve._thinking_model import build_thinking_model
from tests.serve.conftest import Server, start_server, stop_server

QUESTION = [{"role": "user", "content": "Why is the sky blue?"}]
Thinker = tuple[Server, str, str]
"""The server, the reasoning and the content its model answers."""


@pytest.fixture(scope="module")
def thinker(demo: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Thinker]:
    path = tmp_path_factory.mktemp("thinker") / "model"
    reasoning, content = build_thinking_model(demo, path)
    srv = start_server(str(path), "--reasoning-parser=qwen3")
    yield srv, reasoning, content
    stop_server(srv)


@pytest.fixture(scope="module")
def client(thinker) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{thinker[0].url}/v1", api_key="unused", timeout=60) as c:
        yield c


def test_the_answer_is_split_into_reasoning_and_content(thinker, client):
    _, reasoning, content = thinker
    got = client.chat.completions.create(model=thinker[0].model, messages=QUESTION)
    message = got.choices[0].message
    assert message.content == content
    assert message.model_extra["reasoning_content"] == reasoning
    assert got.choices[0].finish_reason == "stop"


def test_streamed_deltas_carry_reasoning_then_content_and_no_marker(thinker, client):
    _, reasoning, content = thinker
    stream = client.chat.completions.create(model=thinker[0].model, messages=QUESTION, stream=True)
    kinds, texts = [], {"reasoning_content": "", "content": ""}
    for chunk in stream:
        delta = chunk.choices[0].delta
        for kind in texts:
            piece = getattr(delta, kind, None) or (delta.model_extra or {}).get(kind)
            if piece:
                kinds.append(kind)
                texts[kind] += piece
                assert "think>" not in piece
    assert texts == {"reasoning_content": reasoning, "content": content}
    assert kinds == sorted(kinds, key=lambda k: k == "content")  # reasoning first, then content
    assert len(kinds) > 2  # streamed piece by piece, not once at the end


def test_enable_thinking_false_reaches_the_template_and_all_is_content(thinker):
    srv, _, _ = thinker

    def chat(**extra: object) -> dict:
        body = {"messages": QUESTION, "max_tokens": 8, **extra}
        return httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60).json()

    on, off = chat(), chat(chat_template_kwargs={"enable_thinking": False})
    block = httpx.post(f"{srv.url}/tokenize", json={"prompt": "<think>\n\n</think>\n\n"})
    grown = off["usage"]["prompt_tokens"] - on["usage"]["prompt_tokens"]
    assert grown == block.json()["count"] > 0  # the template wrote the empty think block
    message = off["choices"][0]["message"]
    assert message["reasoning_content"] is None and message["content"]


def test_structured_outputs_start_after_the_reasoning(thinker, client):
    _, reasoning, _ = thinker
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    got = client.chat.completions.create(
        model=thinker[0].model,
        messages=QUESTION,
        max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )
    message = got.choices[0].message
    assert message.model_extra["reasoning_content"] == reasoning  # not held to the schema
    assert isinstance(json.loads(message.content)["ok"], bool)
    bad = {"messages": QUESTION, "structured_outputs": {"regex": "(unclosed"}}
    resp = httpx.post(f"{thinker[0].url}/v1/chat/completions", json=bad, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "structured_outputs"


def test_an_echoed_prompt_is_content_as_it_is_and_only_the_answer_is_parsed(thinker, client):
    _, reasoning, content = thinker
    said = "Weighed it.</think> So:"  # the parser would split here, were it shown the echo
    messages = [*QUESTION, {"role": "assistant", "content": said}]
    got = client.chat.completions.create(
        model=thinker[0].model, messages=messages, extra_body={"echo": True}
    )
    message = got.choices[0].message
    assert message.content == said + content
    assert message.model_extra["reasoning_content"] == reasoning
    stream = client.chat.completions.create(
        model=thinker[0].model, messages=messages, extra_body={"echo": True}, stream=True
    )
    texts = {"reasoning_content": "", "content": ""}
    for chunk in stream:
        delta = chunk.choices[0].delta
        for kind in texts:
            texts[kind] += getattr(delta, kind, None) or (delta.model_extra or {}).get(kind) or ""
    assert texts == {"reasoning_content": reasoning, "content": said + content}
