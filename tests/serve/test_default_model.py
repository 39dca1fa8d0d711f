"""`kvserve serve` with no --model: the real default model answers as LLM.chat does."""

from __future__ import annotations

import importlib.util

import openai
import pytest

from kvserve.default_model import DEFAULT_PACKAGE, INSTALL_DEFAULT
from tests.serve.conftest import start_server, stop_server

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec(DEFAULT_PACKAGE) is None, reason=f"needs `{INSTALL_DEFAULT}`"
)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.slow
def test_the_default_model_serves_chat():
    """(Token equality with LLM.chat is tested on the demo checkpoint, which loads faster.)"""
    srv = start_server(None)
    try:
        with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", timeout=120) as client:
            [card] = client.models.list().data
            got = client.chat.completions.create(
                model=card.id, messages=QUESTION, max_tokens=12, temperature=0
            )
            streamed = client.chat.completions.create(
                model=card.id, messages=QUESTION, max_tokens=12, temperature=0, stream=True
            )
            text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    finally:
        log = stop_server(srv)
    assert "SmolLM2" in log and "Traceback" not in log
    assert card.id == "SmolLM2-135M-Instruct"
    assert got.choices[0].message.content == text
    assert "Paris" in text
    assert got.usage.completion_tokens <= 12 and got.usage.prompt_tokens_details is not None
