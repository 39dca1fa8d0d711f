"""kvserve replicas on a two-node Ray cluster, behind Serve's proxy, routed by kvserve's request
router: multi-turn chats land where their history is, every predicted hit is the hit the
replica reports, answers are the engine's own; a replica killed under load loses no request
that had not started, and predictions are exact again once Serve has replaced it; on the
benchmark's chats, the replicas report more cached tokens than behind Serve's default
router (an application of its own, deployed beside, its replicas starting with the others).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from benchmarks.serve_load import Target, multi_turn, run_rounds
from kvserve import LLM, SamplingParams
from kvserve.model.checkpoint.tokenizer import load_tokenizer
from tests.ray.conftest import ENGINE, deploy, ray, wait_for
from tests.router._workload import FOLLOW_UPS, OPENERS, client
from tests.serve.conftest import scrape

pytestmark = pytest.mark.slow
MAX_TOKENS = 12
REPLICAS = 3
"""Behind each router: with two, Serve's choice would keep a chat's history by chance every
other turn, and the comparison would be a coin's."""
KVSERVE = {
    "num_replicas": REPLICAS,
    "ray_actor_options": {"num_cpus": 1},
    "health_check_period_s": 1,
}
"""One CPU each: the head node's two and the other's one. A killed one is found within a
second (Serve's default: 10)."""
DEFAULT = {
    "num_replicas": REPLICAS,
    "ray_actor_options": {"num_cpus": 0},
    "request_router": "serve-default",
}
"""Serve's Power-of-Two router over replicas of their own (wherever Ray puts them)."""


@pytest.fixture(scope="module")
def apps(ray_cluster, demo):
    return deploy(demo, {"kvserve": KVSERVE, "default": DEFAULT})


@pytest.fixture(scope="module")
def served(apps):
    return apps["kvserve"]


def ask(c, model: str, messages: list, salt: str, stream: bool) -> tuple[str, int, str]:
    """(answer, cached_tokens, the replica that answered)."""
    kwargs = {
        "model": model,
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "extra_body": {"cache_salt": salt},
    }
    if not stream:
        raw = c.chat.completions.with_raw_response.create(**kwargs)
        out = raw.parse()
        cached = out.usage.prompt_tokens_details.cached_tokens
        return out.choices[0].message.content or "", cached, raw.headers["kvserve-replica"]
    options = {"include_usage": True}
    with c.chat.completions.with_streaming_response.create(
        **kwargs, stream=True, stream_options=options
    ) as raw:
        replica = raw.headers["kvserve-replica"]
        chunks = list(raw.parse())
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    return text, chunks[-1].usage.prompt_tokens_details.cached_tokens, replica


def chats(url: str, model: str, salt: str, n: int = 4, turns: int = 3):
    """n conversations (their own cache salts), a turn's requests sent at once; odd ones are
    streamed. Per conversation: [(messages, answer, cached, replica)] turn by turn."""
    convs = [[{"role": "user", "content": f"{OPENERS[k]} a story {k}."}] for k in range(n)]
    log: list[list[tuple[list, str, int, str]]] = [[] for _ in range(n)]
    with client(url) as c, ThreadPoolExecutor(n) as pool:
        for turn in range(turns):
            asked = [list(conv) for conv in convs]
            answers = list(
                pool.map(
                    lambda k, asked=asked: ask(c, model, asked[k], f"{salt}-{k}", k % 2 == 1),
                    range(n),
                )
            )
            for k, (text, cached, replica) in enumerate(answers):
                log[k].append((asked[k], text, cached, replica))
                convs[k] += [
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]},
                ]
    return log


def test_chats_land_where_their_history_is_and_hit_as_predicted(served, ray_cluster, demo):
    # Three replicas, on both nodes.
    assert len(_engine_nodes("kvserve")) == 2
    log = chats(served.url, demo, "routed")
    series = {k: v for k, v in scrape(served).items() if "_created" not in k}
    for turns in log:
        first_replica = turns[0][3]
        assert [t[3] for t in turns] == [first_replica] * len(turns), (turns, series)
        assert all(t[2] > 0 for t in turns[1:]), turns
    assert len({turns[0][3] for turns in log}) == REPLICAS  # every replica holds some
    assert served.total("prediction_exact_total") == 12, series  # wrong or unverified: which
    assert served.total("prediction_wrong_total") == 0
    cached = sum(t[2] for turns in log for t in turns)
    assert served.total("predicted_hit_tokens_total") == cached
    # Greedy answers are the engine's own.
    llm = LLM(demo, **ENGINE)
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
        asked = [t[0] for turns in log for t in turns]
        expected = [o.outputs[0].text for o in llm.chat(asked, params, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert [t[1] for turns in log for t in turns] == expected


def test_a_hostile_request_is_the_replicas_400_and_the_next_is_answered(served, demo):
    """Through Serve's proxy, the ingress and the request router: what the replicas refuse
    unread (kvserve.request_limits) the router does not tokenize either, and the client
    gets the replica's 400 in OpenAI's body, naming the field; the server goes on."""
    limits = httpx.get(f"{served.url}/kv-metadata", timeout=30).json()["limits"]
    deep: object = "x"
    for _ in range(40):
        deep = {"a": deep}
    too_long = "y" * (limits["max_prompt_chars"] + 1)
    refused = [
        ("completions", {"prompt": ["hi"] * (limits["max_batch_prompts"] + 1)}, "prompt",
         "at most 256 prompts"),
        ("completions", {"prompt": "hi", "user": deep}, None, "nests deeper than 32"),
        ("completions", {"prompt": too_long}, "prompt", "longer than any prompt"),
        ("chat/completions", {"messages": [{"role": "user", "content": too_long}]},
         "messages", "longer than any prompt"),
        ("completions", {"prompt": "hi", "n": limits["max_n"] + 1}, "n", "--max-n"),
    ]  # fmt: skip
    started = time.monotonic()
    for path, body, param, says in refused:
        answer = httpx.post(f"{served.url}/v1/{path}", json={"model": demo, **body}, timeout=30)
        assert answer.status_code == 400, answer.text[:300]
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["type"] == "invalid_request_error" and error["param"] == param, error
        assert says in error["message"], error
    assert time.monotonic() - started < 10  # none tokenized, on the router or a replica
    body = {"model": demo, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
    answer = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4


def _engine_actors(app: str) -> dict[str, object]:
    """The application's engine replicas' actors, by Serve's replica id."""
    return {
        a["name"].rsplit("#", 1)[-1]: ray.get_actor(a["name"], namespace=a["namespace"])
        for a in ray.util.list_named_actors(all_namespaces=True)
        if f"{app}#kvserve-engine#" in a["name"]
    }


def _engine_nodes(app: str) -> set[str]:
    """The Ray nodes the application's engine replicas live on."""
    where = [
        a.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id())
        for a in _engine_actors(app).values()
    ]
    return set(ray.get(where))


def test_a_replica_killed_under_load_loses_no_request_not_started(served, demo):
    # Every view in sync first: the router then books what it sends each replica.
    wait_for(lambda: len(served.followed()) == REPLICAS, 60, "every replica followed")
    before = served.followed()
    victim, actor = next(iter(_engine_actors("kvserve").items()))

    def sent() -> float:  # what the router has sent the victim (absent until the first)
        try:
            return served.value("requests_total", victim)
        except KeyError:
            return 0.0

    sent_before = sent()
    body = {"max_tokens": 300, "temperature": 0, "extra_body": {"ignore_eos": True}}
    failures: list[BaseException] = []

    def one(k: int) -> None:
        messages = [{"role": "user", "content": f"{OPENERS[k % len(OPENERS)]} load {k}."}]
        try:
            with client(served.url) as c:
                c.chat.completions.create(model=demo, messages=messages, **body)
        except BaseException as exc:
            failures.append(exc)

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, k) for k in range(8)]
        # Killed once the router has sent it work (300 tokens each: still running then).
        wait_for(lambda: sent() > sent_before, 30, "a request on the victim")
        time.sleep(0.2)
        ray.kill(actor, no_restart=True)
        for f in futures:
            f.result()
    # Non-streamed: nothing reached a client before its answer ended, so every request
    # the killed replica held was resent elsewhere.
    assert failures == []
    assert served.value("retries_total", victim) >= 1  # it held some when it died
    # Serve replaces it; the router drops the dead one's view and follows the new one.
    wait_for(
        lambda: len(served.followed()) == REPLICAS and victim not in served.followed(),
        90,
        "a new replica",
    )
    assert served.followed() != before
    wrong_before = served.total("prediction_wrong_total")
    exact_before = served.total("prediction_exact_total")
    log = chats(served.url, demo, "after", n=2, turns=2)
    assert served.total("prediction_wrong_total") == wrong_before
    assert served.total("prediction_exact_total") == exact_before + 4
    for turns in log:
        assert turns[1][3] == turns[0][3] and turns[1][2] > 0


def test_more_cached_tokens_than_behind_serves_default_router(apps, demo):
    """benchmarks/ray_serve.py's comparison, small: its multi-turn chats (a system prompt
    they all share, a first message of their own, then short follow-ups), three replicas
    behind each router, both loaded at once. In rounds (every chat's next turn at once, in
    a shuffled order): in a closed loop a turn follows the answer that freed a slot on its
    replica, and Serve's choice by load sends it back there by chance."""
    kvserve, default = apps["kvserve"], apps["default"]
    tokenizer = load_tokenizer(demo)
    chats = multi_turn(0, 8, 3, 128, 32, lambda text: len(tokenizer.encode(text)))

    async def both():
        body = {"ignore_eos": True, "cache_salt": "shared-prefix"}
        targets = [Target(app.url, demo, body) for app in (kvserve, default)]
        return await asyncio.gather(*(run_rounds(t, chats, 8, seed=0) for t in targets))

    runs = asyncio.run(both())
    answers = [[r for chat in run.results for r in chat] for run in runs]
    assert [r.error for rs in answers for r in rs if r.error] == []
    assert [len(rs) for rs in answers] == [24, 24]
    ours, theirs = (sum(r.cached_tokens for r in rs) for rs in answers)
    ratio = ours / max(theirs, 1)
    print(f"cached tokens: kvserve router {ours}, Serve's default {theirs}: {ratio:.2f}x")
    assert ours >= 1.3 * theirs, f"{ratio:.2f}x"
