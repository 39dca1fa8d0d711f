"""LoRA adapters on Ray Serve: the kvserve application's `lora_modules` reach its replicas,
a request's `model` picks the adapter, answers are an engine's own with that adapter, and
the request router's predictions for adapter requests are exact. Run-time loads and
unloads through the ingress reach every replica (kvserve.ray.adapters): a load is served
by both replicas, a failed one is undone, an unload leaves none serving it, and a replica
Serve starts again after a kill comes back with the run-time adapters."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from kvserve import LLM, LoRARequest, SamplingParams
from tests.lora.conftest import make_adapter
from tests.lora.test_lora_cli import _Base
from tests.ray.conftest import deploy, ray, wait_for

pytestmark = pytest.mark.slow
MAX_TOKENS = 8
KEY = "ray-lora-key"
AUTH = {"authorization": f"Bearer {KEY}"}
PROMPTS = [f"Tell me about river number {k} and its fish." for k in range(8)]
APP = "lora"


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def adapter(demo, tmp_path_factory):
    return make_adapter(_Base(demo), tmp_path_factory.mktemp("ray-lora") / "tuned", seed=21)


@pytest.fixture(scope="module")
def served(ray_cluster, demo, adapter):
    args = {"num_replicas": 2, "ray_actor_options": {"num_cpus": 1},
            "lora_modules": [f"tuned={adapter.path}"], "api_key": KEY,
            "health_check_period_s": 1}  # fmt: skip
    return deploy(demo, {APP: args})[APP]


@pytest.fixture(scope="module")
def later(demo, tmp_path_factory):
    """An adapter loaded at run time, and what a lone engine answers with it."""
    made = make_adapter(_Base(demo), tmp_path_factory.mktemp("ray-lora") / "later", seed=22)
    alone = LLM(demo, enable_lora=True, num_threads=1, num_kv_blocks=256)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outs = alone.generate(PROMPTS, params, use_tqdm=False,
                          lora_request=LoRARequest("later", 1, made.path))  # fmt: skip
    base = alone.generate(PROMPTS, params, use_tqdm=False)
    alone.shutdown()
    assert [o.outputs[0].text for o in outs] != [o.outputs[0].text for o in base]
    return made, {p: o.outputs[0].text for p, o in zip(PROMPTS, outs, strict=True)}


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


def _replicas(deployment: str = "kvserve-engine") -> dict[str, object]:
    """The application's replicas' actors of a deployment, by Serve's replica id."""
    return {
        a["name"].rsplit("#", 1)[-1]: ray.get_actor(a["name"], namespace=a["namespace"])
        for a in ray.util.list_named_actors(all_namespaces=True)
        if f"{APP}#{deployment}#" in a["name"]
    }


def _book() -> dict[str, str]:
    from ray import serve

    _, _, entries = serve.get_deployment_handle("kvserve-adapters", APP).read.remote().result()
    return entries


def _running(deployment: str = "kvserve-engine") -> int:
    """How many of the deployment's replicas Serve has initialized (RUNNING)."""
    from ray import serve

    app = serve.status().applications.get(APP)
    if app is None or deployment not in app.deployments:
        return 0
    states = app.deployments[deployment].replica_states
    return sum(n for state, n in states.items() if getattr(state, "value", state) == "RUNNING")


def _adapters_by_replica() -> dict[str, set[str]]:
    """What each replica serves, as it tells the request router (its routing stats); asked
    of initialized replicas only (a replica Serve is still starting refuses the call)."""
    wait_for(lambda: _running() == len(_replicas()), 120, "every replica initialized")
    actors = _replicas()
    stats = ray.get([a.record_routing_stats.remote() for a in actors.values()], timeout=60)
    return {
        replica: {e["name"] for e in s["kvserve"]["lora_adapters"]}
        for replica, s in zip(actors, stats, strict=True)
    }


def _book_or_none() -> dict[str, str] | None:
    try:
        return _book()
    except Exception:  # Serve is starting the book's replica again
        return None


def _change(served, what: str, body: dict, key: bool = True) -> httpx.Response:
    headers = AUTH if key else {}
    return httpx.post(f"{served.url}/v1/{what}_lora_adapter", json=body, headers=headers,
                      timeout=120)  # fmt: skip


def _ask_all(served, model: str, salt: str) -> list[tuple[int, str, str]]:
    """Every prompt at once, four at a time: (status, text, the replica that answered). Under
    a new `salt` nothing is cached: the router spreads them by load."""

    def one(prompt: str) -> tuple[int, str, str]:
        body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "cache_salt": salt}  # fmt: skip
        answer = httpx.post(f"{served.url}/v1/completions", json=body, headers=AUTH, timeout=120)
        text = answer.json()["choices"][0]["text"] if answer.status_code == 200 else answer.text
        return answer.status_code, text, answer.headers.get("kvserve-replica", "")

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, PROMPTS))


def _served_everywhere(served, later, tag: str) -> None:
    """Both replicas list `later` and answer it as the lone engine does."""
    _, want = later
    assert all("later" in names for names in _adapters_by_replica().values())
    seen: set[str] = set()
    for k in range(6):  # concurrent requests spread by load; until both have answered some
        answers = _ask_all(served, "later", f"{tag}-{k}")
        for prompt, (status, text, replica) in zip(PROMPTS, answers, strict=True):
            assert status == 200, text
            assert text == want[prompt]  # the adapter's own answer, on whichever replica
            seen.add(replica)
        if len(seen) == 2:
            break
    assert seen == set(_replicas())
    with client(served.url) as c:  # the openai client picks it by `model` too
        out = c.completions.create(model="later", prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                   temperature=0)  # fmt: skip
        assert out.model == "later" and out.choices[0].text == want[PROMPTS[0]]


def test_a_run_time_load_reaches_every_replica_and_is_predicted_exactly(served, later):
    made, _ = later
    body = {"lora_name": "later", "lora_path": made.path}
    refused = _change(served, "load", body, key=False)
    assert refused.status_code == 401 and "API key" in refused.json()["error"]["message"]
    assert all("later" not in names for names in _adapters_by_replica().values())
    wrong_before = served.total("prediction_wrong_total")
    answer = _change(served, "load", body)
    assert answer.status_code == 200 and "later" in answer.text, answer.text
    _served_everywhere(served, later, "loaded")
    with client(served.url) as c:
        assert {"later", "tuned"} <= {m.id for m in c.models.list().data}
    exact, unverified = (served.total(f"prediction_{n}_total") for n in ("exact", "unverified"))
    again = _ask_all(served, "later", "loaded-0")  # hits, each predicted exactly
    assert all(status == 200 for status, _, _ in again)
    assert served.total("prediction_exact_total") == exact + len(PROMPTS)
    assert served.total("prediction_unverified_total") == unverified
    assert served.total("prediction_wrong_total") == wrong_before


def test_a_replica_serve_starts_again_has_the_run_time_adapter(served, later):
    made, _ = later
    answer = _change(served, "load", {"lora_name": "later", "lora_path": made.path})
    assert answer.status_code in (200, 400), answer.text  # 400: loaded by the test before
    assert _book() == {"later": made.path}
    # The book's replica killed: Serve's new one is taught the adapters by the replicas.
    (book,) = _replicas("kvserve-adapters").values()
    ray.kill(book, no_restart=True)
    wait_for(lambda: _book_or_none() == {"later": made.path}, 120, "the book taught again")
    before = _replicas()
    victim = next(iter(before))
    ray.kill(before[victim], no_restart=True)
    wait_for(lambda: len(served.followed()) == 2 and victim not in served.followed(), 120,
             "Serve's new replica")  # fmt: skip
    assert victim not in _replicas() and len(_replicas()) == 2
    _served_everywhere(served, later, "restarted")


def test_a_failed_load_is_undone_on_every_replica(served, demo, tmp_path):
    missing = {"lora_name": "missing", "lora_path": str(tmp_path / "nowhere")}
    answer = _change(served, "load", missing)
    assert answer.status_code == 400, answer.text
    assert "not a directory" in answer.json()["error"]["message"]
    assert all("missing" not in names for names in _adapters_by_replica().values())
    nested = httpx.post(f"{served.url}/v1/load_lora_adapter", content=b"[" * 100_000,
                        headers=AUTH, timeout=60)  # fmt: skip
    assert nested.status_code == 400 and "Traceback" not in nested.text
    # One replica already serves the name (loaded on it alone): the other's load is undone.
    other = make_adapter(_Base(demo), tmp_path / "other", seed=23)
    from ray import serve

    first, second = list(_replicas())
    path = "/v1/load_lora_adapter"
    headers = [(b"content-type", b"application/json"), (b"authorization", f"Bearer {KEY}".encode())]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http",
             "method": "POST", "path": path, "raw_path": path.encode(), "root_path": "",
             "query_string": b"", "headers": headers}  # fmt: skip
    body = {"lora_name": "half", "lora_path": other.path}
    engine = serve.get_deployment_handle("kvserve-engine", APP)
    told = engine.broadcast("adapter_change", scope, json.dumps(body).encode(), [first])
    assert [a["status"] for a in told.results(timeout_s=120) if a is not None] == [200]
    answer = _change(served, "load", body)
    assert answer.status_code == 400 and "half" in answer.json()["error"]["message"]
    assert "half" not in _adapters_by_replica()[second]  # its load was undone
    # The replicas differ now: the adapter's requests go only to the one that serves it.
    answers = _ask_all(served, "half", "half-0")
    assert {(status, replica) for status, _, replica in answers} == {(200, first)}, answers
    with client(served.url) as c:
        assert "missing" not in {m.id for m in c.models.list().data}


def test_an_unload_removes_it_from_every_replica(served, later):
    made, _ = later
    _change(served, "load", {"lora_name": "later", "lora_path": made.path})
    answer = _change(served, "unload", {"lora_name": "later"})
    assert answer.status_code == 200, answer.text
    assert all("later" not in names for names in _adapters_by_replica().values())
    answers = _ask_all(served, "later", "gone-0") + _ask_all(served, "later", "gone-1")
    assert {status for status, _, _ in answers} == {404}
    assert {replica for _, _, replica in answers} == set(_replicas())
    again = _change(served, "unload", {"lora_name": "later"})
    assert again.status_code == 400 and "later" in again.json()["error"]["message"]
    with client(served.url) as c:
        out = c.completions.create(model="tuned", prompt="Hello", max_tokens=2)
        assert out.model == "tuned"
