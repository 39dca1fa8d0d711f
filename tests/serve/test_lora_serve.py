"""`kvserve serve --enable-lora --lora-modules`: the request's `model` picks the adapter on
every endpoint (peft's greedy text through the openai client), /v1/models lists them, load
and unload at run time (a running request keeps its adapter), lora_requests_info in
/metrics, each adapter's identity in /kv-metadata."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers

from tests.lora.conftest import Adapter, make_adapter
from tests.serve.conftest import Server, metric, scrape, start_server, stop_server
from tests.serve.test_errors import error_of

BASE = "base"
KEY = "lora-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [3, 17, 29, 41, 5]
TOKENS = 5


class _Base:
    """The demo checkpoint (random weights, a real tokenizer) as make_adapter's base."""

    def __init__(self, path: str) -> None:
        self.hf_model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()


class Setup:
    def __init__(self, server: Server, base: _Base, adapters: dict[str, Adapter], root: Path):
        self.server, self.base, self.adapters, self.root = server, base, adapters, root
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(server.model)

    def post(self, path: str, body: dict, key: bool = True) -> httpx.Response:
        return httpx.post(
            f"{self.server.url}{path}", json=body, headers=AUTH if key else {}, timeout=120
        )

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def base_reference(self, prompt: list[int]) -> list[int]:
        with torch.no_grad():
            out = self.base.hf_model.generate(
                input_ids=torch.tensor([prompt]), do_sample=False, max_new_tokens=TOKENS,
                pad_token_id=0,
            )  # fmt: skip
        return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def setup(demo, tmp_path_factory) -> Iterator[Setup]:
    root = tmp_path_factory.mktemp("served-adapters")
    base = _Base(demo)
    adapters = {
        "adapter-a": make_adapter(base, root / "a", seed=11),
        "adapter-b": make_adapter(base, root / "b", seed=12, targets=["q_proj", "v_proj"]),
        "adapter-c": make_adapter(base, root / "c", seed=13, rank=8),
    }
    server = start_server(
        demo, "--served-model-name", BASE, "--enable-lora", "--max-loras", "2",
        "--lora-modules", f"adapter-a={adapters['adapter-a'].path}",
        json.dumps({"name": "adapter-b", "path": adapters["adapter-b"].path}),
        env={"KVSERVE_API_KEY": KEY},
    )  # fmt: skip
    yield Setup(server, base, adapters, root)
    stop_server(server)


@pytest.fixture(scope="module")
def client(setup) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{setup.server.url}/v1", api_key=KEY, timeout=120) as c:
        yield c


def _complete(client: openai.OpenAI, model: str, prompt: list[int] = PROMPT) -> str:
    out = client.completions.create(
        model=model, prompt=prompt, max_tokens=TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert out.model == model
    return out.choices[0].text


def test_the_model_picks_the_adapter_and_gives_peft_s_text(setup, client):
    for name in ("adapter-a", "adapter-b"):
        expected = setup.text(setup.adapters[name].reference(PROMPT, TOKENS))
        assert _complete(client, name) == expected, name
    assert _complete(client, BASE) == setup.text(setup.base_reference(PROMPT))
    assert len({_complete(client, m) for m in (BASE, "adapter-a", "adapter-b")}) == 3


def test_chat_with_an_adapter_is_peft_s_over_the_rendered_prompt(setup, client):
    messages = [{"role": "user", "content": "Name a colour."}]
    rendered = setup.post("/tokenize", {"model": "adapter-b", "messages": messages})
    assert rendered.status_code == 200, rendered.text
    ids = rendered.json()["tokens"]
    out = client.chat.completions.create(
        model="adapter-b", messages=messages, max_tokens=TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert out.model == "adapter-b"
    assert out.choices[0].message.content == setup.text(
        setup.adapters["adapter-b"].reference(ids, TOKENS)
    )


def test_other_endpoints_take_adapter_names(setup):
    body = {"model": "adapter-a", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    resp = setup.post("/v1/messages", body)
    assert resp.status_code == 200 and resp.json()["model"] == "adapter-a", resp.text
    resp = setup.post(
        "/v1/responses", {"model": "adapter-b", "input": "hi", "max_output_tokens": 2}
    )
    assert resp.status_code == 200 and resp.json()["model"] == "adapter-b", resp.text
    vectors = {}
    for model in (BASE, "adapter-a"):
        resp = setup.post("/v1/embeddings", {"model": model, "input": "hello"})
        assert resp.status_code == 200 and resp.json()["model"] == model, resp.text
        vectors[model] = resp.json()["data"][0]["embedding"]
    assert vectors[BASE] != vectors["adapter-a"]
    resp = setup.post("/detokenize", {"model": "adapter-a", "tokens": PROMPT})
    assert resp.status_code == 200
    error = error_of(setup.post("/v1/completions", {"model": "nope", "prompt": "x"}), 404)
    assert error["code"] == "model_not_found" and "'adapter-a'" in error["message"]


def test_models_lists_the_adapters_under_the_base(setup):
    data = httpx.get(f"{setup.server.url}/v1/models", headers=AUTH).json()["data"]
    cards = {card["id"]: card for card in data}
    assert list(cards)[:3] == [BASE, "adapter-a", "adapter-b"]
    assert cards[BASE]["parent"] is None
    for name in ("adapter-a", "adapter-b"):
        assert cards[name]["parent"] == BASE
        assert cards[name]["root"] == setup.adapters[name].path


def test_kv_metadata_lists_each_adapter_s_identity(setup):
    body = httpx.get(f"{setup.server.url}/kv-metadata", headers=AUTH).json()
    listed = {a["name"]: a for a in body["lora_adapters"]}
    a, b = listed["adapter-a"]["identity"], listed["adapter-b"]["identity"]
    assert a.startswith("lora-sha256:") and b.startswith("lora-sha256:") and a != b


@pytest.mark.slow
def test_load_while_a_request_runs_then_unload(setup, client):
    a_runs = _stream(setup, "adapter-a", tokens=1000)  # outlasts the load and the scrape
    path = setup.adapters["adapter-c"].path
    resp = setup.post("/v1/load_lora_adapter", {"lora_name": "adapter-c", "lora_path": path})
    assert resp.status_code == 200 and "adapter-c" in resp.text, resp.text
    info = scrape(setup.server)
    assert metric(info, "kvserve:lora_requests_info", max_lora="2") > 1e9  # a timestamp
    assert "adapter-a" in _running_adapters(info)
    expected = setup.text(setup.adapters["adapter-c"].reference(PROMPT, TOKENS))
    assert _complete(client, "adapter-c") == expected
    c_runs = _stream(setup, "adapter-c")  # unloaded while it runs: it finishes with it
    resp = setup.post("/v1/unload_lora_adapter", {"lora_name": "adapter-c"})
    assert resp.status_code == 200, resp.text
    error = error_of(setup.post("/v1/completions", {"model": "adapter-c", "prompt": "x"}), 404)
    assert error["code"] == "model_not_found"
    models = httpx.get(f"{setup.server.url}/v1/models", headers=AUTH).json()["data"]
    assert "adapter-c" not in {card["id"] for card in models}
    for runs in (a_runs, c_runs):
        runs.thread.join(timeout=300)
        assert runs.finish == ["length"], runs.finish


class _Streamed:
    def __init__(self) -> None:
        self.started = threading.Event()
        self.finish: list[str] = []
        self.thread: threading.Thread


def _stream(setup: Setup, model: str, tokens: int = 300) -> _Streamed:
    """A long streamed completion in the background; back once its first chunk came."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    runs = _Streamed()

    def read() -> None:
        url = f"{setup.server.url}/v1/completions"
        with httpx.stream("POST", url, json=body, headers=AUTH, timeout=300) as resp:
            for line in resp.iter_lines():
                runs.started.set()
                if line.startswith("data: {"):
                    reason = json.loads(line[6:])["choices"][0]["finish_reason"]
                    runs.finish += [reason] if reason else []
        runs.started.set()

    runs.thread = threading.Thread(target=read, daemon=True)
    runs.thread.start()
    assert runs.started.wait(120)
    return runs


def _running_adapters(values: dict[str, float]) -> str:
    for key in values:
        if key.startswith("kvserve:lora_requests_info{"):
            return key.split("running_lora_adapters=")[1].split(",waiting")[0]
    raise KeyError("no lora_requests_info")


def test_bad_loads_and_unloads_are_400s_and_the_server_keeps_serving(setup, client, tmp_path):
    load, unload = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
    missing = {"lora_name": "x", "lora_path": str(tmp_path / "none")}
    error = error_of(setup.post(load, missing), 400)
    assert "not a directory" in error["message"] and error["param"] == "lora_path"
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_model.bin").write_bytes(b"x")
    error = error_of(setup.post(load, {"lora_name": "x", "lora_path": str(pickled)}), 400)
    assert "pickle" in error["message"]
    fifo = tmp_path / "fifo"  # its config a FIFO: refused unread (reading would block)
    fifo.mkdir()
    (fifo / "adapter_model.safetensors").write_bytes(b"x")
    os.mkfifo(fifo / "adapter_config.json")
    error = error_of(setup.post(load, {"lora_name": "x", "lora_path": str(fifo)}), 400)
    assert "not a regular file" in error["message"]
    path = setup.adapters["adapter-a"].path
    error = error_of(setup.post(load, {"lora_name": "adapter-a", "lora_path": path}), 400)
    assert "already served" in error["message"]
    error = error_of(setup.post(load, {"lora_name": BASE, "lora_path": path}), 400)
    assert "already served" in error["message"]
    error = error_of(setup.post(load, {"lora_name": "y", "lora_path": path, "extra": 1}), 400)
    assert error["param"] == "extra"
    error = error_of(setup.post(load, {"lora_name": 3, "lora_path": path}), 400)
    assert error["param"] == "lora_name"
    error = error_of(setup.post(unload, {"lora_name": "never-loaded"}), 400)
    assert "never-loaded" in error["message"] and "adapter-a" in error["message"]
    assert setup.post(load, {"lora_name": "z", "lora_path": path}, key=False).status_code == 401
    assert _complete(client, "adapter-a") == setup.text(
        setup.adapters["adapter-a"].reference(PROMPT, TOKENS)
    )


def test_without_enable_lora_load_and_unload_say_so(server):
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        body = {"lora_name": "x", "lora_path": "/tmp"}
        error = error_of(httpx.post(f"{server.url}{path}", json=body, timeout=30), 404)
        assert "--enable-lora" in error["message"]
    info = httpx.get(f"{server.url}/metrics", timeout=30).text
    assert "lora_requests_info" not in info
