"""kvserve replicas on Ray Serve (issue 31): kvserve's request router against Serve's default
router and against `kvserve route`, and what Serve's proxy adds to a request.

A local Ray cluster of `--nodes` nodes (Ray's test utilities, loopback) holds `--replicas`
replicas of the checkpoint (the tiny demo one by default, `--model PATH` for a real one),
`--threads` each. Every target gets fresh replicas (empty caches), is warmed up, then takes
serve_load.py's multi-turn chats (`--chats` chats x `--turns` turns, a first message of
about `--first-tokens` tokens, then `--turn-tokens`, each turn the whole history, all chats
at once, `--max-tokens` greedy tokens an answer, streamed; with `--rounds`, in rounds, as
tests/ray sends them: every chat's next turn at once, in a shuffled order, once all the
turns before are answered):

- `Ray Serve, kvserve router`: `kvserve.ray:app` as `serve run` deploys it;
- `Ray Serve, default router`: the same, `request_router=serve-default` (Serve's
  Power-of-Two choice);
- `kvserve route`: the same number of `kvserve serve` processes outside Ray, behind
  `kvserve route` (cache-aware), after the Ray cluster is gone.

Columns: cached share (prompt tokens the replicas reported cached), TTFT p50 / p99, each as
a ratio to the default router's, and for kvserve's routers their predictions (exact /
wrong: a chat's first turn shares the system prompt with the chats sent with it, so a hit
that a request in flight creates between the choice and the admission is not predicted).
Then the proxy's added latency: one replica on Ray Serve and one `kvserve serve`, each
taking `--latency-requests` one-token requests one at a time; the difference of the p50
end-to-end times is what Serve's proxy, the ingress and the handle call add.

The machine is shared: the load average is printed with the table; compare ratios from one
run, not seconds across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from machine import cpu
from serve_load import Conversation, Run, Target, run_rounds, run_workload, summarize
from serve_load import Workload as LoadWorkload
from serve_load import multi_turn as chat_workload
from serve_targets import Process, child_env, free_port, kvserve_process, note, warm_up_prompt

KVSERVE = "Ray Serve, kvserve router"
DEFAULT = "Ray Serve, default router"
ROUTE = "kvserve route (no Ray)"
OBJECT_STORE_BYTES = 100 * 2**20


def main() -> None:
    args = parse_args()
    if args.model is None:
        from kvserve.model.demo import ensure_demo_model

        args.model = ensure_demo_model(Path(tempfile.mkdtemp(prefix="ray-bench-")))
    workload = chat_workload(
        args.seed, args.chats, args.turns, args.first_tokens, args.turn_tokens, word_count(args)
    )
    load_before = os.getloadavg()
    results: dict[str, dict[str, Any]] = {}
    latency: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as logs:
        cluster = start_cluster(args)
        try:
            for label, router in ((KVSERVE, "kvserve"), (DEFAULT, "serve-default")):
                url = deploy(args, router, args.replicas)
                results[label] = measure(url, workload, args, router == "kvserve")
                undeploy()
            url = deploy(args, "kvserve", 1)
            latency["Ray Serve (1 replica)"] = one_at_a_time(url, args)
            undeploy()
        finally:
            stop_cluster(cluster)
        results[ROUTE] = route_outside_ray(args, workload, Path(logs))
        direct = kvserve_process(args, "direct", [], Path(logs))
        try:
            direct.wait_ready()
            latency["kvserve serve (direct)"] = one_at_a_time(direct.url, args)
        finally:
            direct.stop()
    print_tables(args, results, latency, load_before, os.getloadavg())


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a checkpoint (default: the tiny random demo checkpoint)")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--nodes", type=int, default=2, help="Ray nodes (replicas split evenly)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per replica")
    p.add_argument("--engine-args", default="--num-kv-blocks 2048", help="for every replica")
    p.add_argument("--chats", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--first-tokens", type=int, default=256)
    p.add_argument("--turn-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--latency-requests", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", action="store_true", help="chats in rounds, not a closed loop")
    return p.parse_args()


def word_count(args: argparse.Namespace) -> Any:
    from kvserve.model.checkpoint.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    return lambda text: len(tokenizer.encode(text))


# -- Ray ---------------------------------------------------------------------------------


def start_cluster(args: argparse.Namespace) -> Any:
    import ray
    from ray.cluster_utils import Cluster

    per_node = -(-args.replicas // args.nodes)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": per_node,
            "object_store_memory": OBJECT_STORE_BYTES,
            "include_dashboard": False,
        },
    )
    for _ in range(args.nodes - 1):
        cluster.add_node(num_cpus=per_node, object_store_memory=OBJECT_STORE_BYTES)
    ray.init(address=cluster.address, logging_level="warning", log_to_driver=False)
    from ray import serve

    args.serve_port = free_port()
    serve.start(
        proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": args.serve_port}
    )
    return cluster


def stop_cluster(cluster: Any) -> None:
    import ray

    try:
        ray.shutdown()
    finally:
        cluster.shutdown()


def deploy(args: argparse.Namespace, router: str, replicas: int) -> str:
    """`kvserve.ray:app` with fresh replicas; its URL once every replica is routed to."""
    from ray import serve

    from kvserve.ray import app

    engine = dict(zip(*[iter(args.engine_args.split())] * 2, strict=True))
    options = {k.removeprefix("--").replace("-", "_"): v for k, v in engine.items()}
    application = app(
        {
            "model": args.model,
            "served_model_name": "bench",
            "num_replicas": replicas,
            "ray_actor_options": {"num_cpus": 1},
            "num_threads": args.threads,
            "request_router": router,
            **options,
        }
    )
    serve.run(application, name="bench", route_prefix="/")
    url = f"http://127.0.0.1:{args.serve_port}"
    deadline = time.monotonic() + 120
    while router == "kvserve" and followed(url) < replicas:
        if time.monotonic() > deadline:
            raise SystemExit("the router never followed every replica's events")
        time.sleep(0.5)
    return url


def undeploy() -> None:
    from ray import serve

    serve.delete("bench")


def followed(url: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        1 for line in text.splitlines() if line.startswith("kvserve:router_events_followed{")
        and line.endswith(" 1.0")
    )  # fmt: skip


def router_totals(url: str) -> dict[str, float]:
    """The routing book's totals over the replicas (kvserve's router only)."""
    totals: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("kvserve:router_prediction_"):
            name = line.split("{", 1)[0].removeprefix("kvserve:router_prediction_")
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


# -- the load ----------------------------------------------------------------------------


def measure(url: str, workload: LoadWorkload, args: argparse.Namespace, ours: bool) -> dict:
    target = Target(url, "bench", {"ignore_eos": True})
    warm = LoadWorkload("warm-up", [warm_up_prompt(), Conversation("Be brief.", ("Hi!",))], "")
    asyncio.run(run_workload(target, warm, 1, 4, float("inf"), 0))
    before = router_totals(url) if ours else {}
    note(f"  {url}: {len(workload.jobs)} chats x {args.turns} turns")
    jobs = len(workload.jobs)
    run: Run = asyncio.run(
        run_rounds(target, workload, args.max_tokens, args.seed)
        if args.rounds
        else run_workload(target, workload, jobs, args.max_tokens, float("inf"), args.seed)
    )
    summary = summarize([run])
    if ours:
        after = router_totals(url)
        summary["predictions"] = {k: after[k] - before.get(k, 0.0) for k in after}
    return summary


def one_at_a_time(url: str, args: argparse.Namespace) -> dict[str, Any]:
    target = Target(url, "bench", {"ignore_eos": True})
    jobs: list[Any] = [
        Conversation("Be brief.", (f"Say {k}.",)) for k in range(args.latency_requests)
    ]
    asyncio.run(run_workload(target, LoadWorkload("warm-up", jobs[:2], ""), 1, 1, float("inf"), 0))
    run = asyncio.run(run_workload(target, LoadWorkload("one", jobs, ""), 1, 1, float("inf"), 0))
    return summarize([run])


def route_outside_ray(args: argparse.Namespace, workload: LoadWorkload, logs: Path) -> dict:
    replicas = []
    for rank in range(args.replicas):
        events = {
            "enable_kv_cache_events": True,
            "endpoint": f"tcp://127.0.0.1:{free_port()}",
            "replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
            "bind": True,
        }
        extra = ["--kv-events-config", json.dumps(events)]
        replicas.append(kvserve_process(args, f"replica {rank}", extra, logs))
    router = None
    try:
        for r in replicas:
            r.wait_ready()
        cmd = [sys.executable, "-m", "kvserve.cli", "route", "--port", "{port}"]
        for r in replicas:
            cmd += ["--replica", r.url]
        router = Process("kvserve route", cmd, child_env(1), logs)
        router.wait_ready()
        return measure(router.url, workload, args, True)  # the same /metrics names
    finally:
        if router is not None:
            router.stop()
        for r in replicas:
            r.stop()


# -- the tables --------------------------------------------------------------------------


def ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.2f}" if value is not None and base else "n/a"


def ms(value: float | None) -> str:
    return f"{1000 * value:.1f}" if value is not None else "n/a"


def print_tables(
    args: argparse.Namespace,
    results: dict[str, dict[str, Any]],
    latency: dict[str, dict[str, Any]],
    load_before: tuple[float, float, float],
    load_after: tuple[float, float, float],
) -> None:
    cpus = os.cpu_count()
    print(
        f"# {time.strftime('%Y-%m-%d')}, {cpu()}, {cpus} cpus, load average "
        f"{load_before[0]:.1f} before / {load_after[0]:.1f} after, "
        f"{args.replicas} replicas on {args.nodes} Ray nodes, {args.threads} thread(s) each, "
        f"{Path(args.model).name}; {args.chats} chats x {args.turns} turns (first message "
        f"~{args.first_tokens} tokens, then {args.turn_tokens}), {args.max_tokens} greedy "
        f"tokens an answer, all chats at once{' in rounds' if args.rounds else ''}\n"
    )
    base = results[DEFAULT]
    print("| target | cached share | ÷ default | TTFT p50 ms | ÷ default | TTFT p99 ms | ÷ default "
          "| errors | predictions exact / wrong |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for label, s in results.items():
        share = s["cached_share"]
        p = s.get("predictions")
        predictions = f"{p.get('exact_total', 0):.0f} / {p.get('wrong_total', 0):.0f}" if p else ""
        print(
            f"| {label} | {share:.3f} | {ratio(share, base['cached_share'])} "
            f"| {ms(s['ttft_p50'])} | {ratio(s['ttft_p50'], base['ttft_p50'])} "
            f"| {ms(s['ttft_p99'])} | {ratio(s['ttft_p99'], base['ttft_p99'])} "
            f"| {s['errors']} | {predictions} |"
        )
    print(f"\n{args.latency_requests} one-token chat requests, one at a time, one replica:\n")
    print("| target | end-to-end p50 ms | TTFT p50 ms |")
    print("|---|---|---|")
    for label, s in latency.items():
        print(f"| {label} | {ms(s['e2e_p50'])} | {ms(s['ttft_p50'])} |")
    ray_e2e, direct_e2e = (s["e2e_p50"] for s in latency.values())
    added = ms(ray_e2e - direct_e2e)
    print(f"\nadded by Serve's proxy, the ingress and the handle call: {added} ms a request "
          f"(p50), {ratio(ray_e2e, direct_e2e)}x direct")  # fmt: skip


if __name__ == "__main__":
    main()
