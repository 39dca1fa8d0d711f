"""Prefill on one replica, decode on another, on Ray Serve (`kvserve.ray:app` with `prefill`
and `decode` sections): greedy tokens through the application equal transformers' for the
same tiny checkpoint, the decode replica pulls the prompt's blocks from the prefill replica
it was told of through Ray, a short prompt skips the prefill, and a prefill replica that
Serve restarts (another port) is found by its next answer."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.ray.conftest import ENGINE, RayServe, ray, wait_for
from tests.serve.conftest import scrape

pytestmark = pytest.mark.slow
NEW = 6
MIN_TOKENS = 16
LONG = [[3 + (7 * i + j) % 250 for j in range(40)] for i in range(4)]
SHORT = [5, 9, 17, 33, 65, 129, 7, 11]
"""Fewer tokens than MIN_TOKENS: computed by the decode replica alone."""
PREFILL_TIMEOUT = 8
"""Long enough for any prefill of these tiny models on a loaded machine."""
COMMON = {**ENGINE, "block_size": 4, "dtype": "float32", "prefill_min_tokens": MIN_TOKENS,
          "prefill_timeout": PREFILL_TIMEOUT}  # fmt: skip
SPLIT = {
    "prefill": {"num_replicas": 1, "offload": "cpu:64MiB", "health_check_period_s": 1,
                "ray_actor_options": {"num_cpus": 0.5}},
    "decode": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.5}},
}  # fmt: skip


@pytest.fixture(scope="module")
def apps(ray_cluster, request) -> dict[str, tuple[RayServe, Any]]:
    """The split of each model kind as an application of its own, all deployed at once (six
    replicas of half a CPU each, on the cluster's three)."""
    from ray import serve

    from kvserve.ray import app
    from tests._ports import free_port

    kinds = {"split": request.getfixturevalue("checkpoints")["llama"],
             "gemma3": request.getfixturevalue("gemma3_checkpoint")}  # fmt: skip
    with contextlib.suppress(pytest.skip.Exception):  # no oracle with some transformers
        kinds["bamba"] = request.getfixturevalue("bamba_checkpoint")
    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    served = {}
    for name, ck in kinds.items():
        args = {"model": ck.path, **COMMON, **SPLIT}
        served[name] = (RayServe(f"http://127.0.0.1:{port}/{name}", ck.path, name, args), ck)
    serve.run_many([
        serve.RunTarget(app(s.args), name=name, route_prefix=f"/{name}")
        for name, (s, _) in served.items()
    ])  # fmt: skip
    for s, _ in served.values():  # predicted from the first request on
        wait_for(lambda s=s: len(s.followed()) == 2, 60, "both replicas' KV events")
    return served


@pytest.fixture(scope="module")
def served(apps):
    return apps["split"]


def complete(url: str, prompt: list[int], stream: bool = False) -> tuple[list[int], int]:
    """(the greedy tokens, the cached tokens the answer reported)."""
    body = {"prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "stream": stream}  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
        names: list[str] = []
        cached = -1
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
            assert resp.status_code == 200, resp.read()
            for line in resp.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk["choices"]:
                    names += choice["logprobs"]["tokens"]
                if chunk.get("usage"):
                    cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
        return [int(n.removeprefix("token_id:")) for n in names], cached
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    names = out["choices"][0]["logprobs"]["tokens"]
    cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
    return [int(n.removeprefix("token_id:")) for n in names], cached


def replicas(role: str, app: str = "split") -> dict[str, str]:
    """The application's live replicas of one role: Serve's replica id -> actor name."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    return {n.rsplit("#", 1)[-1]: n for n in names if f"{app}#kvserve-{role}#" in n}


def by_role(split: RayServe, name: str, role: str) -> float:
    """A replica-labelled series summed over the application's live replicas of one role."""
    values = scrape(split)
    live = replicas(role, split.name)
    return sum(values.get(f"kvserve:router_{name}{{replica={r}}}", 0.0) for r in live)


def test_split_tokens_equal_one_engines_and_the_blocks_travel(served):
    split, ck = served
    for i, prompt in enumerate(LONG[:3]):
        tokens, cached = complete(split.url, prompt, stream=i == 2)
        assert tokens == ck.reference(prompt, NEW)
        assert cached >= len(prompt) // 2  # pulled from the prefill replica, not computed
    assert by_role(split, "requests_total", "prefill") == 3
    assert by_role(split, "requests_total", "decode") == 3
    for role, name in (("decode", "received"), ("prefill", "served")):  # routing stats: ~1 s
        series = f"replica_kv_transfer_blocks_{name}"
        wait_for(lambda: by_role(split, series, role) > 0, 10, f"blocks {name}")  # noqa: B023
    assert by_role(split, "prediction_wrong_total", "prefill") == 0


def test_a_short_prompt_skips_the_prefill(served):
    split, ck = served
    before = by_role(split, "requests_total", "prefill")
    tokens, _ = complete(split.url, SHORT)
    assert tokens == ck.reference(SHORT, NEW)
    # And a prompt the decode replica holds already: nothing left to prefill.
    tokens, cached = complete(split.url, LONG[0])
    assert tokens == ck.reference(LONG[0], NEW) and cached >= len(LONG[0]) - 4
    # A body the router cannot read is the decode replica's 400, in OpenAI's format, and
    # is never prefilled.
    for body in (b"{not json", json.dumps({"prompt": {"ids": LONG[3]}}).encode()):
        resp = httpx.post(f"{split.url}/v1/completions", content=body, timeout=30,
                          headers={"content-type": "application/json"})  # fmt: skip
        assert resp.status_code == 400 and "message" in resp.json()["error"]
    assert by_role(split, "requests_total", "prefill") == before


def replica_processes(app: str, role: str) -> list[int]:
    """The pids of an application's live replicas of one role (Ray titles a replica's worker
    process `ray::ServeReplica:<app>:<deployment>`)."""
    title = f"ServeReplica:{app}:kvserve-{role}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            if entry.isdigit() and title in Path(f"/proc/{entry}/cmdline").read_bytes():
                pids.append(int(entry))
    return pids


def test_a_prefill_replica_that_does_not_answer_costs_the_deadline_only(served):
    """The prefill replica's process stopped (SIGSTOP): past `prefill_timeout` the ingress
    leaves the call, and the decode replica computes the prompt; the fallback is counted."""
    split, ck = served
    pids = replica_processes("split", "prefill")
    assert pids, "no prefill replica process found"
    before = scrape(split)
    prompt = [t + 50 for t in LONG[2]]  # held by no replica
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        tokens, cached = complete(split.url, prompt)
        waited = time.monotonic() - started
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    assert tokens == ck.reference(prompt, NEW) and cached == 0  # computed by decode
    assert waited >= PREFILL_TIMEOUT  # it did wait for the prefill first
    after = scrape(split)
    timeouts = [k for k in after if k.startswith("kvserve:router_prefill_fallbacks_total{")
                and "reason=timeout" in k]  # fmt: skip
    assert sum(after[k] - before.get(k, 0.0) for k in timeouts) == 1


def test_a_restarted_prefill_replica_is_found_through_ray(served):
    split, ck = served
    ((old, name),) = replicas("prefill").items()
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    wait_for(lambda: set(replicas("prefill")) - {old}, 90, "Serve's new prefill replica")
    received = by_role(split, "replica_kv_transfer_blocks_received", "decode")
    for k in range(5):  # a prompt no replica holds yet, until the new replica runs it
        prompt = [t + k for t in LONG[3]]
        tokens, cached = complete(split.url, prompt)
        assert tokens == ck.reference(prompt, NEW)  # right, whatever happened to the prefill
        if cached:
            break
        time.sleep(1)
    assert cached >= len(prompt) // 2  # pulled from the new replica, at its new port
    wait_for(
        lambda: by_role(split, "replica_kv_transfer_blocks_received", "decode") > received,
        10,
        "the pulled blocks counted",
    )


@pytest.mark.parametrize("arch", ["gemma3", "bamba"])
def test_sliding_windows_and_mamba_states_travel_through_serve(arch, apps):
    """Gemma 3 (the last window of a sliding-window group) and Bamba (the Mamba state at the
    prompt's end)."""
    if arch not in apps:
        pytest.skip(f"no {arch} oracle with this transformers")
    hybrid, ck = apps[arch]
    for prompt in LONG[:2]:
        tokens, cached = complete(hybrid.url, prompt)
        assert tokens == ck.reference(prompt, NEW)
        assert cached >= len(prompt) // 2
    assert by_role(hybrid, "requests_total", "prefill") == 2
