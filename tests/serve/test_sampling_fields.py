"""Logprobs, penalties and logit_bias through the server equal what LLM.generate returns."""

from __future__ import annotations

import httpx
import pytest

from kvserve import SamplingParams

PROMPT = "Once upon a time the model said"
CHAT = [{"role": "user", "content": "Say something."}]

FLOAT32 = 1e-4
"""How far a float32 log-softmax may land from the same one computed in another process: the
server batches, chunks and hits its prefix cache differently from the test's engine, so its
matmuls sum in another order, and those rounding differences grow through the layers (seen:
-0.01235557 against -0.01235545, then -0.6443497 against -0.6443461 in CI). A wrong token,
temperature or normalisation moves a logprob by far more than this."""


def test_completion_logprobs_equal_llm_generate_streamed_or_not(server, client, llm):
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3)
    want = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    kwargs = {"model": server.model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    got = client.completions.create(**kwargs, logprobs=3).choices[0]
    lp = got.logprobs
    assert lp.token_logprobs == pytest.approx(
        [s[t].logprob for t, s in zip(want.token_ids, want.logprobs, strict=True)], abs=FLOAT32
    )
    assert len(lp.tokens) == len(want.token_ids) == len(lp.text_offset) == 6
    assert all(3 <= len(top) <= 4 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    chunks = list(client.completions.create(**kwargs, logprobs=3, stream=True))
    streamed = [
        x
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for x in c.choices[0].logprobs.token_logprobs
    ]
    offsets = [
        x
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for x in c.choices[0].logprobs.text_offset
    ]
    assert streamed == lp.token_logprobs and offsets == lp.text_offset
    plain = client.completions.create(**kwargs).choices[0]
    assert plain.logprobs is None and plain.text == got.text


def test_chat_logprobs_with_top_alternatives(server, client, llm):
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=2)
    want = llm.chat(CHAT, params, use_tqdm=False)[0].outputs[0]
    got = client.chat.completions.create(
        model=server.model,
        messages=CHAT,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    ).choices[0]
    content = got.logprobs.content
    assert len(content) == len(want.token_ids)
    for item, token_id, step in zip(content, want.token_ids, want.logprobs, strict=True):
        assert item.logprob == pytest.approx(step[token_id].logprob, abs=FLOAT32)
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob <= item.top_logprobs[0].logprob + 1e-6
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token
    only = client.chat.completions.create(
        model=server.model, messages=CHAT, max_tokens=2, temperature=0, logprobs=True
    ).choices[0]
    assert [len(i.top_logprobs) for i in only.logprobs.content] == [0, 0]


def test_penalties_and_logit_bias_equal_llm_generate(server, client, llm):
    fields = {"repetition_penalty": 1.5, "presence_penalty": 0.5, "frequency_penalty": 0.3}
    want = llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=8, **fields), use_tqdm=False
    )[0].outputs[0]
    got = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body=fields
    )
    assert got.choices[0].text == want.text
    forced = llm.get_tokenizer().encode(" the")[-1]
    biased = client.completions.create(
        model=server.model,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        logit_bias={str(forced): 100},
        logprobs=0,
    )
    assert biased.choices[0].logprobs.tokens == [llm.get_tokenizer().decode([forced])] * 4


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "logprobs": 99}, "logprobs"),
        ({"prompt": "x", "presence_penalty": 5}, "presence_penalty"),
        ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "x", "logit_bias": {"5": 500}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"999999999": 1}}, "logit_bias"),
        ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": CHAT, "logprobs": True, "top_logprobs": 99}, "top_logprobs"),
    ],
)
def test_bad_sampling_fields_are_400s_naming_them(server, body, param):
    path = "chat/completions" if "messages" in body else "completions"
    resp = httpx.post(f"{server.url}/v1/{path}", json={"max_tokens": 2, **body}, timeout=60)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
