"""Completions and chat through a real server equal LLM.generate / LLM.chat, streamed or not."""

from __future__ import annotations

import json

import httpx

from kvserve import SamplingParams

PROMPTS = ["Hello there, how are", "The capital of France is"]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is a KV cache? ünïcödé ✓"},
]


def test_greedy_completions_equal_llm_generate(server, client, llm):
    expected = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    for prompt, want in zip(PROMPTS, expected, strict=True):
        got = client.completions.create(
            model=server.model, prompt=prompt, max_tokens=12, temperature=0
        )
        assert got.choices[0].text == want.outputs[0].text
        assert got.usage.completion_tokens == len(want.outputs[0].token_ids)
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
        assert got.choices[0].finish_reason == want.outputs[0].finish_reason


def test_token_id_prompt_and_stop_fields(server, client, llm):
    ids = llm.get_tokenizer().encode(PROMPTS[1])
    want = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    got = client.completions.create(model=server.model, prompt=ids, max_tokens=8, temperature=0)
    assert got.choices[0].text == want.outputs[0].text
    extra = {"top_k": 5, "min_p": 0.0, "ignore_eos": True, "min_tokens": 2}
    sampled = client.completions.create(
        model=server.model, prompt="abc", max_tokens=4, seed=7, n=2, user="u1", extra_body=extra
    )
    assert len(sampled.choices) == 2 and sampled.usage.completion_tokens == 8


def test_chat_equals_llm_chat(server, client, llm):
    want = llm.chat(CONVERSATION, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    got = client.chat.completions.create(
        model=server.model, messages=CONVERSATION, max_tokens=12, temperature=0
    )
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.usage.completion_tokens == len(want.outputs[0].token_ids)
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)


def test_streamed_completion_adds_up_to_the_plain_one(server, client):
    kwargs = {"model": server.model, "prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0}
    plain = client.completions.create(**kwargs)
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == plain.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_streamed_chat_role_first_finish_last_done_last(server):
    body = {
        "model": server.model,
        "messages": CONVERSATION,
        "max_tokens": 16,
        "temperature": 0,
    }
    plain = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json=stream_body, timeout=60
    ) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    usage = events[-1]
    assert usage["choices"] == [] and usage["usage"] == plain["usage"]
    deltas = [e["choices"][0] for e in events[1:-1]]
    text = "".join(d["delta"].get("content", "") for d in deltas)
    assert text == plain["choices"][0]["message"]["content"]
    assert deltas[-1]["finish_reason"] == plain["choices"][0]["finish_reason"]
    assert all(d["finish_reason"] is None for d in deltas[:-1])


def test_a_repeated_prompt_reports_cached_tokens(server, client):
    prompt = "A long shared prefix that fills several blocks of four tokens each. " * 3
    first = client.completions.create(model=server.model, prompt=prompt, max_tokens=2)
    again = client.completions.create(model=server.model, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_models_health_version_tokenize(server, client, llm):
    assert [m.id for m in client.models.list().data] == [server.model]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPTS[0]}).json()["tokens"]
    assert ids == llm.get_tokenizer().encode(PROMPTS[0])
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text == PROMPTS[0]
