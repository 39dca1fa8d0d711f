"""`vllm bench serve`'s warm-up against a real server: identical block-aligned prompts at once.

Its warm-up sends the same random-token prompt (a block multiple, 256 tokens)
as several concurrent streamed completions; kvserve once answered every
request of that step with a 500 (issue 25). Here: the same burst, streamed
and concurrent, then again with the prompt cached, and as one batched
request (its prompts are admitted in one step for sure); every answer is the
greedy answer of LLM.generate for one copy.
"""

from __future__ import annotations

import asyncio
import json

import httpx

from kvserve import SamplingParams
from tests.serve.conftest import ENGINE

COPIES = 4
NEW = 8


def block_aligned_ids(vocab: int, seed: int, length: int = 256) -> list[int]:
    assert length % ENGINE["block_size"] == 0 and length % 16 == 0
    return [(seed + i * 13) % (vocab - 20) + 10 for i in range(length)]


async def streamed(client: httpx.AsyncClient, model: str, ids: list[int]) -> str:
    body = {"model": model, "prompt": ids, "max_tokens": NEW, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    text = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[len("data: ") :])
                assert "error" not in chunk, chunk
                text.append(chunk["choices"][0]["text"])
    return "".join(text)


async def burst(url: str, model: str, ids: list[int]) -> list[str]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        return await asyncio.gather(*(streamed(client, model, ids) for _ in range(COPIES)))


def test_identical_block_aligned_burst_is_answered_whole(server, llm):
    vocab = llm.get_tokenizer().vocab_size
    ids, other = block_aligned_ids(vocab, 7), block_aligned_ids(vocab, 11)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    want, want_other = (
        o.outputs[0].text for o in llm.generate([ids, other], params, use_tqdm=False)
    )
    for _ in range(2):  # cold, then with the prompt cached
        assert asyncio.run(burst(server.url, server.model, ids)) == [want] * COPIES
    batched = httpx.post(  # a cold prompt's copies, admitted in one step
        f"{server.url}/v1/completions",
        json={
            "model": server.model,
            "prompt": [other] * COPIES,
            "max_tokens": NEW,
            "temperature": 0,
            "ignore_eos": True,
        },
        timeout=120,
    )
    assert batched.status_code == 200, batched.text
    assert [c["text"] for c in batched.json()["choices"]] == [want_other] * COPIES
