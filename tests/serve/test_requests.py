"""Request features through a real server: batches, n, seeds, stops, echo, salts, concurrency."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from kvserve import LLM, SamplingParams
from tests.serve.conftest import ENGINE

PROMPTS = [f"Story number {i} begins with a" for i in range(32)]


@pytest.fixture(scope="module")
def llm(demo):
    engine = LLM(demo, **ENGINE)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=60) as c:
        yield c


def test_a_batch_of_prompts_with_n_completions_each(server, client, llm):
    prompts = [PROMPTS[0], llm.get_tokenizer().encode(PROMPTS[1])]
    want = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    got = client.completions.create(
        model=server.model, prompt=prompts, max_tokens=6, temperature=0, n=2
    )
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    texts = [c.text for c in got.choices]
    assert texts == [want[0].outputs[0].text] * 2 + [want[1].outputs[0].text] * 2
    assert got.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)
    assert got.usage.completion_tokens == 4 * 6


def test_a_seed_reproduces_sampled_completions(server, client):
    def sample(seed: int) -> list[str]:
        out = client.completions.create(
            model=server.model, prompt=PROMPTS[2], max_tokens=8, n=3, seed=seed, temperature=5.0
        )
        return [c.text for c in out.choices]

    first = sample(11)
    assert sample(11) == first
    assert len(set(first)) > 1  # each completion samples on its own
    assert sample(12) != first


def test_stop_strings_match_llm_generate(server, client, llm):
    free = llm.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    text = free[0].outputs[0].text
    stop = text[len(text) // 2 :][:3]  # a piece of what it would say
    params = SamplingParams(temperature=0, max_tokens=16, stop=[stop])
    want = llm.generate([PROMPTS[3]], params, use_tqdm=False)[0].outputs[0]
    got = client.completions.create(
        model=server.model, prompt=PROMPTS[3], max_tokens=16, temperature=0, stop=[stop]
    )
    assert want.finish_reason == "stop" and stop not in want.text
    assert (got.choices[0].text, got.choices[0].finish_reason) == (want.text, "stop")


def test_echo_puts_the_prompt_first_streamed_or_not(server, client):
    kwargs = {"model": server.model, "prompt": PROMPTS[4], "max_tokens": 5, "temperature": 0}
    plain = client.completions.create(**kwargs)
    echoed = client.completions.create(**kwargs, echo=True)
    assert echoed.choices[0].text == PROMPTS[4] + plain.choices[0].text
    streamed = client.completions.create(**kwargs, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == echoed.choices[0].text


def test_cached_tokens_equal_llm_generate_and_salts_never_share(server, client, demo):
    prompt = "Tenants share this preamble, which fills a few blocks of four tokens. " * 2
    fresh = LLM(demo, **ENGINE)
    try:
        params = SamplingParams(temperature=0, max_tokens=2)
        fresh.generate([prompt], params, use_tqdm=False)
        want = fresh.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens
    finally:
        fresh.shutdown()

    def cached(**extra) -> int:
        out = client.completions.create(
            model=server.model, prompt=prompt, max_tokens=2, extra_body=extra
        )
        return out.usage.prompt_tokens_details.cached_tokens

    cached()
    assert want > 0 and cached() == want
    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-b") == 0
    assert cached(cache_salt="tenant-a") == want


def test_32_concurrent_streaming_clients_get_their_own_tokens(server, llm):
    want = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)

    async def one(client: httpx.AsyncClient, prompt: str) -> tuple[str, int]:
        body = {
            "model": server.model,
            "prompt": prompt,
            "max_tokens": 12,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        text, tokens = "", 0
        async with client.stream("POST", f"{server.url}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if chunk["choices"]:
                    text += chunk["choices"][0]["text"]
                else:
                    tokens = chunk["usage"]["completion_tokens"]
        return text, tokens

    async def all_of_them() -> list[tuple[str, int]]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, p) for p in PROMPTS))

    got = asyncio.run(all_of_them())
    assert got == [(w.outputs[0].text, len(w.outputs[0].token_ids)) for w in want]


def test_a_bad_prompt_in_a_batch_names_its_index(server):
    body = {"model": server.model, "prompt": ["fine", ""], "max_tokens": 2}
    resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 400 and "prompt[1]" in resp.json()["error"]["message"]
