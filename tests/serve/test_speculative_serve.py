"""`kvserve serve --speculative-config JSON`: the same greedy answers, and vLLM's
spec_decode series in /metrics moving with the drafts.

The server drafts with a draft model, the demo model itself (one server per
module: the JSON reaches the engine by the same path for every method, and
prompt lookup is tested in process and on the command line in tests/engine);
as its own draft the model must have every draft accepted."""

from __future__ import annotations

import json

import openai
import pytest

from kvserve import SamplingParams
from tests.serve.conftest import metric, scrape, start_server, stop_server

SPEC = {"method": "draft_model", "num_speculative_tokens": 3}
PROMPT = "The cat sat on the mat. The cat sat on the mat. The cat sat on the"


@pytest.fixture(scope="module")
def spec_server(demo):
    server = start_server(demo, "--speculative-config", json.dumps({**SPEC, "model": demo}))
    yield server
    stop_server(server)


def test_greedy_answers_equal_the_engine_without_speculation(spec_server, llm):
    before = scrape(spec_server)
    with openai.OpenAI(base_url=f"{spec_server.url}/v1", api_key="unused", timeout=60) as c:
        answer = c.completions.create(
            model=spec_server.model, prompt=PROMPT, max_tokens=24, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
    [expected] = llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False
    )
    assert answer.choices[0].text == expected.outputs[0].text
    after = scrape(spec_server)

    def delta(name: str) -> float:
        return metric(after, f"kvserve:{name}") - metric(before, f"kvserve:{name}")

    drafts = delta("spec_decode_num_draft_tokens_total")
    accepted = delta("spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and accepted == drafts  # the model as its own draft
    assert delta("spec_decode_num_drafts_total") > 0
    by_position = sum(
        metric(after, "kvserve:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
        for i in range(SPEC["num_speculative_tokens"])
    )
    assert by_position == metric(after, "kvserve:spec_decode_num_accepted_tokens_total")
    rate = metric(after, "kvserve:spec_decode_draft_acceptance_rate")
    total = metric(after, "kvserve:spec_decode_num_draft_tokens_total")
    assert rate == pytest.approx(
        metric(after, "kvserve:spec_decode_num_accepted_tokens_total") / total
    )
    assert delta("generation_tokens_total") == answer.usage.completion_tokens == 24
