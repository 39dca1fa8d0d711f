"""The HTTP API fuzzed from its own OpenAPI document (/openapi.json) with schemathesis:
bodies that fit the schema and bodies that do not, on every route. No answer is a 5xx,
and every 4xx is OpenAI's error body. CI-sized: a bounded number of examples, each
generating at most a few tokens (the document's ranges are narrowed for speed only)."""

from __future__ import annotations

from collections import Counter

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

EXAMPLES = {GenerationMode.POSITIVE: 60, GenerationMode.NEGATIVE: 60}
FAST = {
    "max_tokens": 3,
    "max_completion_tokens": 3,
    "max_output_tokens": 3,
    "n": 2,
    "min_tokens": 3,
}


def narrowed(doc: dict) -> dict:
    """Each generation short: a few tokens and completions (the ranges' upper ends only)."""
    for path in doc["paths"].values():
        post = path.get("post")
        if post is None:
            continue
        schema = post["requestBody"]["content"]["application/json"]["schema"]
        for name, top in FAST.items():
            if name in schema.get("properties", {}):
                schema["properties"][name]["maximum"] = top
    return doc


def check(response, case) -> None:
    where = f"{case.method} {case.path} {case.body!r}"[:500]
    assert response.status_code < 500, f"{where} -> {response.status_code} {response.text[:300]}"
    if response.status_code >= 400 and case.path.startswith("/v1/messages"):
        body = response.json()  # Anthropic's error body
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, where
        assert isinstance(body["error"]["message"], str) and body["error"]["message"], where
    elif response.status_code >= 400 and case.path != "/metrics":
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, where
        assert isinstance(error["message"], str) and error["message"], where


@pytest.mark.parametrize(
    "mode",
    [  # positive bodies generate tokens: the long pole of the fast subset
        pytest.param(GenerationMode.POSITIVE, marks=pytest.mark.slow),
        GenerationMode.NEGATIVE,
    ],
    ids=str,
)
def test_no_input_makes_a_5xx_or_a_non_openai_error(server, mode):
    doc = narrowed(httpx.get(f"{server.url}/openapi.json", timeout=10).json())
    schema = schemathesis.openapi.from_dict(doc)
    statuses: Counter[int] = Counter()

    @settings(
        max_examples=EXAMPLES[mode],
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=schema.as_strategy(generation_mode=mode))
    def fuzz(case) -> None:
        response = case.call(base_url=server.url, timeout=60)
        statuses[response.status_code] += 1
        check(response, case)

    fuzz()
    assert {s // 100 for s in statuses} >= ({2, 4} if mode == "positive" else {4}), statuses
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
