"""LoRA adapters on Ray Serve: the kvserve application's `lora_modules` reach its replicas,
a request's `model` picks the adapter, answers are an engine's own with that adapter, and
the request router's predictions for adapter requests are exact."""

from __future__ import annotations

import pytest

from kvserve import LLM, LoRARequest, SamplingParams
from tests.lora.conftest import make_adapter
from tests.lora.test_lora_cli import _Base
from tests.ray.conftest import deploy
from tests.router._workload import client

pytestmark = pytest.mark.slow
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapter(demo, tmp_path_factory):
    return make_adapter(_Base(demo), tmp_path_factory.mktemp("ray-lora") / "tuned", seed=21)


@pytest.fixture(scope="module")
def served(ray_cluster, demo, adapter):
    args = {"num_replicas": 2, "ray_actor_options": {"num_cpus": 1},
            "lora_modules": [f"tuned={adapter.path}"]}  # fmt: skip
    return deploy(demo, {"lora": args})["lora"]


def test_an_adapter_request_through_serve_is_the_adapters_answer(served, demo, adapter):
    messages = [{"role": "user", "content": "Say something about rivers."}]
    alone = LLM(demo, enable_lora=True, num_threads=1, num_kv_blocks=256)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    want = alone.chat(messages, params, use_tqdm=False,
                      lora_request=LoRARequest("tuned", 1, adapter.path))[0]  # fmt: skip
    base = alone.chat(messages, params, use_tqdm=False)[0]
    alone.shutdown()
    assert want.outputs[0].text != base.outputs[0].text  # the adapter changes the answer
    with client(served.url) as c:
        for _ in range(2):  # the second is a hit, predicted on the replica that holds it
            out = c.chat.completions.create(
                model="tuned", messages=messages, max_tokens=MAX_TOKENS, temperature=0
            )
            assert out.model == "tuned"
            assert out.choices[0].message.content == want.outputs[0].text
        assert out.usage.prompt_tokens_details.cached_tokens > 0
        listed = {m.id for m in c.models.list().data}
        assert "tuned" in listed
    assert served.total("prediction_wrong_total") == 0
    assert served.total("prediction_exact_total") >= 2
