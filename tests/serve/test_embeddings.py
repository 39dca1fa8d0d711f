"""/v1/embeddings (issue 30, item 5) on the shared server (`--pooling last`, the default),
with the openai client: transformers' final hidden states pooled by the same rule are the
oracle; mean pooling through `LLM.embed` on the same engine code."""

from __future__ import annotations

import base64
import struct
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from kvserve.pooling_params import PoolingParams
from tests.serve.conftest import metric, scrape

TEXTS = ["The capital of France is Paris.", "Small blocks of memory, shared by every request."]


@pytest.fixture(scope="module")
def oracle(demo: str):
    model = AutoModelForCausalLM.from_pretrained(demo, dtype=torch.float32).eval()

    def embed(ids: list[int], rule: str = "last") -> list[float]:
        with torch.no_grad():
            hidden = model.model(torch.tensor([ids])).last_hidden_state[0]
        pooled = hidden[-1] if rule == "last" else hidden.mean(dim=0)
        return torch.nn.functional.normalize(pooled, dim=0).tolist()

    return embed


def token_ids(server, text: str) -> list[int]:
    return httpx.post(f"{server.url}/tokenize", json={"prompt": text}, timeout=30).json()["tokens"]


def close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-5


def test_a_batch_of_texts_equals_transformers_last_token_state(server, client, oracle):
    got = client.embeddings.create(model=server.model, input=TEXTS)  # the client asks base64
    assert [d.index for d in got.data] == [0, 1]
    ids = [token_ids(server, t) for t in TEXTS]
    for data, prompt in zip(got.data, ids, strict=True):
        assert close(data.embedding, oracle(prompt))
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(map(len, ids))


def test_float_and_base64_are_the_same_numbers_and_token_ids_the_same_as_text(server, client):
    ids = token_ids(server, TEXTS[0])
    floats = client.embeddings.create(model=server.model, input=TEXTS[0], encoding_format="float")
    body = {"input": [ids, ids[:3]], "encoding_format": "base64"}
    raw = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=30).json()
    packed = base64.b64decode(raw["data"][0]["embedding"])
    decoded = list(struct.unpack(f"<{len(packed) // 4}f", packed))
    # equal up to the float rounding of another batch shape (and of a cached prefix)
    assert decoded == pytest.approx(floats.data[0].embedding, abs=1e-6)
    one = client.embeddings.create(model=server.model, input=ids, encoding_format="float")
    assert one.data[0].embedding == pytest.approx(floats.data[0].embedding, abs=1e-6)
    assert raw["usage"]["prompt_tokens"] == len(ids) + 3 and len(raw["data"]) == 2


def test_a_repeated_prompt_hits_the_prefix_cache_and_shares_it_with_generation(server, client):
    prompt = "A pooled prompt whose blocks stay in the cache for the next request. " * 2
    before = scrape(server)
    first = client.embeddings.create(model=server.model, input=prompt, encoding_format="float")
    again = client.embeddings.create(model=server.model, input=prompt, encoding_format="float")
    hits = metric(scrape(server), "kvserve:prefix_cache_hits_total") - metric(
        before, "kvserve:prefix_cache_hits_total"
    )
    assert hits == first.usage.prompt_tokens - 1  # all but the last token, recomputed
    assert again.data[0].embedding == pytest.approx(first.data[0].embedding, abs=1e-6)
    body = {"prompt": prompt, "max_tokens": 2}
    generated = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()
    assert generated["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_generation_and_embeddings_interleave_on_one_server(server, client, oracle):
    def generate(i: int) -> dict:
        body = {"prompt": f"Story {i}:", "max_tokens": 12, "ignore_eos": True}
        return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()

    def embed(i: int) -> list[float]:
        text = f"{TEXTS[i % 2]} ({i})"
        got = client.embeddings.create(model=server.model, input=text, encoding_format="float")
        return got.data[0].embedding

    with ThreadPoolExecutor(6) as pool:
        stories = [pool.submit(generate, i) for i in range(3)]
        vectors = [pool.submit(embed, i) for i in range(3)]
        assert all(s.result()["usage"]["completion_tokens"] == 12 for s in stories)
        for i, vector in enumerate(vectors):
            assert close(vector.result(), oracle(token_ids(server, f"{TEXTS[i % 2]} ({i})")))


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["ok", ""]}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": 7}, "input"),
        ({"input": ["ok", 3]}, "input"),
        ({"input": [1, "a"]}, "input"),
        ({"input": [10**9]}, "input"),
        ({"input": "ok", "dimensions": 8}, "dimensions"),
        ({"input": "ok", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "ok", "truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
        ({"input": "ok", "model": "another"}, "model"),
    ],
)
def test_bad_input_is_a_400_naming_the_field_and_the_server_goes_on(server, client, body, param):
    resp = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=30)
    assert resp.status_code in (400, 404) and resp.json()["error"]["param"] == param
    got = client.embeddings.create(model=server.model, input="still here")
    assert len(got.data[0].embedding) > 0


def test_mean_pooling_equals_transformers_mean_state(llm, oracle):
    """The server's rule is one flag; the engine path below it is LLM.embed's."""
    outputs = llm.embed(TEXTS, PoolingParams("mean"), use_tqdm=False)
    for out in outputs:
        assert close(out.outputs.embedding, oracle(out.prompt_token_ids, "mean"))
    again = llm.embed(TEXTS[:1], PoolingParams("mean"), use_tqdm=False)[0]
    assert again.num_cached_tokens == 0  # mean pooling recomputes every token
    assert again.outputs.embedding == pytest.approx(outputs[0].outputs.embedding, abs=1e-6)
