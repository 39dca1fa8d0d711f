"""Chat as clients send it (issue 30, item 1): no max_tokens runs to the context's end,
chat_template_kwargs and reasoning_effort reach the template, continuous_usage_stats, echo."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator

import httpx
import pytest

from kvserve.serve.request.fields import HEADER
from tests.serve.conftest import Server, start_server, stop_server

MAX_MODEL_LEN = 64
CHAT = [{"role": "user", "content": "Tell me everything."}]
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}no thinking\n{% endif %}"
    "{% if reasoning_effort is defined %}effort {{ reasoning_effort }}\n{% endif %}"
    "{% if refuse is defined %}{{ raise_exception('refused: ' ~ refuse) }}{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""The demo's template, reading `enable_thinking` and `reasoning_effort` as Qwen3's and
gpt-oss's templates do."""


@pytest.fixture(scope="module")
def short(demo: str) -> Iterator[Server]:
    """The demo model with a short context, so a chat without max_tokens ends soon."""
    srv = start_server(demo, f"--max-model-len={MAX_MODEL_LEN}")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def thinking(demo: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The demo checkpoint with a template that reads template variables."""
    path = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(demo, path)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    srv = start_server(str(path))
    yield srv
    stop_server(srv)


def chat(srv: Server, **body: object) -> httpx.Response:
    payload = {"messages": CHAT, "temperature": 0, **body}
    return httpx.post(f"{srv.url}/v1/chat/completions", json=payload, timeout=120)


def test_chat_without_max_tokens_runs_to_the_end_of_the_context(short: Server):
    for body in ({}, {"max_completion_tokens": None}):
        got = chat(short, ignore_eos=True, **body).json()
        usage = got["usage"]
        assert usage["completion_tokens"] == MAX_MODEL_LEN - usage["prompt_tokens"] > 16
        assert got["choices"][0]["finish_reason"] == "length"


def test_max_completion_tokens_and_max_tokens_still_bound_the_answer(short: Server):
    for name in ("max_tokens", "max_completion_tokens"):
        got = chat(short, ignore_eos=True, **{name: 3}).json()
        assert got["usage"]["completion_tokens"] == 3


def test_an_explicit_max_tokens_that_does_not_fit_is_a_400(short: Server):
    resp = chat(short, max_tokens=MAX_MODEL_LEN)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens"


def test_a_prompt_that_fills_the_context_is_a_400_naming_messages(short: Server):
    resp = chat(short, messages=[{"role": "user", "content": "word " * MAX_MODEL_LEN}])
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"


def test_completions_without_max_tokens_still_stop_at_16(short: Server):
    body = {"prompt": "Once upon a time", "ignore_eos": True}
    got = httpx.post(f"{short.url}/v1/completions", json=body, timeout=60).json()
    assert got["usage"]["completion_tokens"] == 16


def test_continuous_usage_stats_puts_usage_on_every_chunk(short: Server):
    body = {
        "messages": CHAT,
        "max_tokens": 5,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    chunks = []
    with httpx.stream("POST", f"{short.url}/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages) and len(chunks) >= 6
    prompt = usages[-1]["prompt_tokens"]
    assert all(u["prompt_tokens"] == prompt for u in usages)
    assert usages[0]["completion_tokens"] == 0 and usages[-1]["completion_tokens"] == 5
    counts = [u["completion_tokens"] for u in usages]
    assert counts == sorted(counts)


def test_chat_echo_puts_the_assistants_last_message_first(short: Server):
    start = "Once upon"
    messages = [*CHAT, {"role": "assistant", "content": start}]
    plain = chat(short, messages=messages, max_tokens=4).json()["choices"][0]["message"]
    echoed = chat(short, messages=messages, max_tokens=4, echo=True).json()
    assert echoed["choices"][0]["message"]["content"] == start + plain["content"]
    user_last = chat(short, max_tokens=4, echo=True).json()["choices"][0]["message"]
    assert (
        user_last["content"] == chat(short, max_tokens=4).json()["choices"][0]["message"]["content"]
    )


def prompt_tokens(resp: httpx.Response) -> int:
    assert resp.status_code == 200, resp.text
    return int(resp.json()["usage"]["prompt_tokens"])


def test_chat_template_kwargs_reach_the_template(thinking: Server):
    plain = prompt_tokens(chat(thinking, max_tokens=1))
    off = chat(thinking, max_tokens=1, chat_template_kwargs={"enable_thinking": False})
    assert prompt_tokens(off) > plain and HEADER not in off.headers
    unknown = chat(thinking, max_tokens=1, chat_template_kwargs={"not_read": 1})
    assert prompt_tokens(unknown) == plain  # the template's business: it ignores it
    effort = chat(thinking, max_tokens=1, reasoning_effort="low")
    assert prompt_tokens(effort) > plain and HEADER not in effort.headers


def test_a_template_that_refuses_its_variables_is_a_400(thinking: Server):
    resp = chat(thinking, max_tokens=1, chat_template_kwargs={"refuse": "x"})
    assert resp.status_code == 400, resp.text
    assert "refused: x" in resp.json()["error"]["message"]
    assert prompt_tokens(chat(thinking, max_tokens=1)) > 0  # still serving


def test_the_router_predicts_the_prompt_the_template_kwargs_give(thinking: Server):
    from transformers import AutoTokenizer

    from kvserve.router.prompts import prompt_token_ids

    tokenizer = AutoTokenizer.from_pretrained(thinking.model)
    body = {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}}
    [ids] = prompt_token_ids(tokenizer, "chat", body) or [[]]
    assert len(ids) == prompt_tokens(chat(thinking, max_tokens=1, **body))
    assert prompt_token_ids(tokenizer, "chat", {**body, "chat_template_kwargs": [1]}) is None


def test_reasoning_effort_is_named_ignored_when_the_template_does_not_read_it(short: Server):
    resp = chat(short, max_tokens=1, reasoning_effort="high")
    assert resp.status_code == 200 and resp.headers[HEADER] == "reasoning_effort"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
        ({"reasoning_effort": 3}, "reasoning_effort"),
        ({"stream": True, "stream_options": {"continuous_usage_stats": 1}}, "stream_options"),
    ],
)
def test_bad_values_are_400s_naming_the_field(short: Server, body: dict, param: str):
    resp = chat(short, max_tokens=1, **body)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param
