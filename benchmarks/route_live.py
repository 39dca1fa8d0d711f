"""The live part of benchmarks/route.py: `kvserve serve` replicas behind a router.

Every target gets fresh replicas (empty caches, counters at zero), started by
this script on free loopback ports with KV events and a replay socket each
(what `kvserve route`'s cache-aware policy reads; vllm-router reads none),
and one router in front of them, straight to the replicas: the fields
vllm-router adds to every body are ignored by `kvserve serve` (named in its
log once, kvserve/serve/request/fields.py), so no proxy sits between them. The
client (serve_load.py) streams the same multi-turn chats through the router;
the replicas' own /metrics say where the requests went.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from serve_load import Conversation, Run, Target, run_workload, summarize
from serve_load import Workload as LoadWorkload
from serve_load import multi_turn as chat_workload
from serve_targets import Process, child_env, free_port, kvserve_process, note, warm_up_prompt

KVSERVE_CA = "kvserve route, cache-aware"
KVSERVE_RR = "kvserve route, round-robin"
VLLM_RR = "vllm-router, round_robin"
VLLM_CA = "vllm-router, cache_aware"
TARGETS = (KVSERVE_CA, KVSERVE_RR, VLLM_RR, VLLM_CA)
"""kvserve's round-robin beside vllm-router's: the same choices, so what differs is the router."""
KVSERVE_POLICY = {KVSERVE_CA: "cache-aware", KVSERVE_RR: "round-robin"}
STAGES = ("tokenize", "predict")
"""kvserve route's own histograms (`kvserve:router_<stage>_seconds`): what routing costs."""
IGNORED_WARNING = "ignoring request field(s) kvserve does not know"
"""How a replica logs the fields it ignored (kvserve/serve/request/fields.py)."""
VLLM_ROUTER_DIR = Path("/tmp/vllm-router-pkg")
"""Where the benchmark's README installs the vllm-router wheel (outside the project venv)."""


@dataclass(slots=True)
class LiveResult:
    label: str
    summary: dict[str, Any]
    cached_tokens: int
    per_replica: list[dict[str, float]] = field(default_factory=list)
    """Each replica's /metrics deltas over the run: requests, prompt and cached tokens."""
    ignored: list[str] = field(default_factory=list)
    """The request fields the replicas ignored (their log's warnings): vllm-router's own."""
    stages: dict[str, Stage] = field(default_factory=dict)
    """kvserve route's routing stages over every round (empty for vllm-router)."""


@dataclass(slots=True)
class Stage:
    """One stage's histogram deltas: observations, their sum, and cumulative bucket counts."""

    count: float = 0.0
    total: float = 0.0
    buckets: dict[float, float] = field(default_factory=dict)

    def plus(self, other: Stage, sign: float = 1.0) -> Stage:
        """This stage with `other` added (sign -1: taken away, a delta between scrapes)."""
        keys = self.buckets.keys() | other.buckets.keys()
        both = {k: self.buckets.get(k, 0.0) + sign * other.buckets.get(k, 0.0) for k in keys}
        return Stage(self.count + sign * other.count, self.total + sign * other.total, both)

    def mean_ms(self) -> float | None:
        return 1000 * self.total / self.count if self.count else None

    def bound_ms(self, q: float) -> float | None:
        """The smallest bucket bound that `q` of the observations stay within (ms)."""
        for le in sorted(self.buckets):
            if self.count and self.buckets[le] >= q * self.count:
                return 1000 * le
        return None


def find_vllm_router(given: str | None) -> tuple[list[str], str | None] | str:
    """(command, extra PYTHONPATH) of vllm-router, or why it cannot run (one line)."""
    path = given or shutil.which("vllm-router") or str(VLLM_ROUTER_DIR / "bin" / "vllm-router")
    if not os.access(path, os.X_OK):
        return f"no vllm-router executable at {path} (--vllm-router PATH)"
    # A `pip install --target DIR` script imports its package from DIR.
    root = Path(path).resolve().parent.parent
    extra = str(root) if (root / "vllm_router").is_dir() else None
    return [path], extra


def vllm_router_version(vllm: tuple[list[str], str | None] | str) -> str:
    """`vllm-router X.Y.Z` from its dist-info (it is not installed in this interpreter)."""
    if isinstance(vllm, str):
        return "vllm-router: none"
    exe, extra = vllm
    infos = sorted(Path(extra).glob("vllm_router-*.dist-info")) if extra else []
    found = infos[-1].name.removesuffix(".dist-info").split("-", 1)[1] if infos else "?"
    return f"vllm-router {found} ({exe[0]})"


def replica_process(args: argparse.Namespace, rank: int, logs: Path) -> Process:
    events = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://127.0.0.1:{free_port()}",
        "replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
        "bind": True,  # an explicit loopback endpoint: bound, as `serve`'s default is
    }
    extra = ["--kv-events-config", json.dumps(events)]
    return kvserve_process(args, f"replica {rank}", extra, logs)


def router_process(
    label: str, urls: list[str], vllm: tuple[list[str], str | None] | None, logs: Path
) -> Process:
    if label in KVSERVE_POLICY:
        cmd = [sys.executable, "-m", "kvserve.cli", "route", "--port", "{port}"]
        cmd += ["--policy", KVSERVE_POLICY[label]]
        for url in urls:
            cmd += ["--replica", url]
        return Process(label, cmd, child_env(1), logs)
    assert vllm is not None
    exe, extra_path = vllm
    policy = "round_robin" if label == VLLM_RR else "cache_aware"
    cmd = [*exe, "--host", "127.0.0.1", "--port", "{port}", "--policy", policy]
    cmd += ["--worker-urls", *urls]
    return Process(label, cmd, child_env(1, extra_path), logs)


def scrape(url: str) -> dict[str, float]:
    """A replica's counters: finished requests, prompt tokens, prefix-cache hit tokens."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {"requests": 0.0, "prompt_tokens": 0.0, "cached_tokens": 0.0}
    names = {
        "kvserve:request_success_total": "requests",
        "kvserve:prompt_tokens_total": "prompt_tokens",
        "kvserve:prefix_cache_hits_total": "cached_tokens",
    }
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            out[names[name]] += float(line.rsplit(" ", 1)[1])
    return out


def scrape_stages(url: str) -> dict[str, Stage]:
    """kvserve route's routing-stage histograms, from its /metrics."""
    stages = {name: Stage() for name in STAGES}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        for name, stage in stages.items():
            metric = f"kvserve:router_{name}_seconds"
            if not line.startswith(metric):
                continue
            value = float(line.rsplit(" ", 1)[1])
            if line.startswith(f"{metric}_count"):
                stage.count = value
            elif line.startswith(f"{metric}_sum"):
                stage.total = value
            elif line.startswith(f"{metric}_bucket"):
                le = line.split('le="', 1)[1].split('"', 1)[0]
                stage.buckets[float(le)] = value
    return stages


def run_target(
    label: str,
    args: argparse.Namespace,
    workload: LoadWorkload,
    vllm: tuple[list[str], str | None] | None,
    logs: Path,
) -> TargetRun:
    """Fresh replicas and one router; warm up, then the chats; the replicas' deltas."""
    note(f"{label}: starting {args.live_replicas} replicas and the router")
    replicas = [replica_process(args, rank, logs) for rank in range(args.live_replicas)]
    router: Process | None = None
    try:
        for r in replicas:
            r.wait_ready()
        router = router_process(label, [r.url for r in replicas], vllm, logs)
        router.wait_ready()
        target = Target(router.url, "bench", {"ignore_eos": True})
        warm = LoadWorkload("warm-up", [warm_up_prompt(), Conversation("Be brief.", ("Hi!",))], "")
        asyncio.run(run_workload(target, warm, 1, 4, float("inf"), 0))
        before = [scrape(r.url) for r in replicas]
        ours = label in KVSERVE_POLICY
        stages_before = scrape_stages(router.url) if ours else {}
        note(f"  {workload.name}: {len(workload.jobs)} chats")
        run: Run = asyncio.run(
            run_workload(
                target, workload, args.concurrency, args.max_tokens, float("inf"), args.seed
            )
        )
        after = [scrape(r.url) for r in replicas]
        stages = scrape_stages(router.url) if ours else {}
    finally:
        if router is not None:
            router.stop()
        for p in replicas:
            p.stop()
    deltas = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]
    spent = {name: stages[name].plus(stages_before[name], -1) for name in stages}
    return TargetRun(run, deltas, ignored_fields(replicas), spent)


@dataclass
class TargetRun:
    """One target's run in one round."""

    run: Run
    deltas: list[dict[str, float]]
    ignored: list[str]
    stages: dict[str, Stage]


def combine(label: str, rounds: list[TargetRun]) -> LiveResult:
    """A target's rounds as one row: latencies over every request of every round;
    cached tokens and the replicas' deltas as means per round."""
    n = len(rounds)
    cached = sum(
        res.cached_tokens or 0
        for r in rounds
        for job in r.run.results
        for res in job
        if res.error is None
    )
    per_replica = [
        {k: sum(r.deltas[i][k] for r in rounds) / n for k in rounds[0].deltas[i]}
        for i in range(len(rounds[0].deltas))
    ]
    ignored = sorted({name for r in rounds for name in r.ignored})
    stages = {name: Stage() for name in rounds[0].stages}
    for r in rounds:
        stages = {name: stages[name].plus(r.stages[name]) for name in stages}
    summary = summarize([r.run for r in rounds])
    return LiveResult(label, summary, round(cached / n), per_replica, ignored, stages)


def ignored_fields(replicas: list[Process]) -> list[str]:
    """The names in the replicas' warnings about ignored request fields (each logs a name once)."""
    names: set[str] = set()
    for r in replicas:
        for line in r.log.read_text(errors="replace").splitlines():
            if IGNORED_WARNING in line:
                names.update(re.findall(r"'([^']*)'", line.split(IGNORED_WARNING, 1)[1]))
    return sorted(names)


def run_live(args: argparse.Namespace, notes: list[str]) -> tuple[str, list[LiveResult]]:
    """(model description, one result per target that ran)."""
    import tempfile

    from kvserve.model.checkpoint.tokenizer import load_tokenizer
    from kvserve.model.demo import ensure_demo_model

    if args.model is None:
        args.model = ensure_demo_model()
        model = f"the demo checkpoint ({args.model})"
    else:
        model = args.model
    tokenizer = load_tokenizer(args.model)
    if tokenizer is None:
        raise SystemExit(f"error: {args.model} has no tokenizer; the chats are text")

    def count(text: str) -> int:
        return len(tokenizer.encode(text))

    workload = chat_workload(
        args.seed, args.conversations, args.turns, args.first_turn_tokens, args.turn_tokens, count
    )
    vllm = find_vllm_router(args.vllm_router)
    if isinstance(vllm, str):
        notes.append(f"vllm-router skipped: {vllm}.")
        note(notes[-1])
    runs: dict[str, list[TargetRun]] = {}
    skipped: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="kvserve-routebench-") as logs:
        for rnd in range(args.rounds):
            # Every other round in reverse order, so a drift in the machine's load
            # weighs on every target alike.
            for label in TARGETS if rnd % 2 == 0 else TARGETS[::-1]:
                if label in skipped or (label not in KVSERVE_POLICY and isinstance(vllm, str)):
                    continue
                router = None if isinstance(vllm, str) else vllm
                try:
                    got = run_target(label, args, workload, router, Path(logs))
                except SystemExit as exc:  # a router that does not start: a note, not the end
                    if label in KVSERVE_POLICY:
                        raise
                    skipped.add(label)
                    notes.append(f"{label} skipped: {str(exc).splitlines()[0]}")
                    note(notes[-1])
                    continue
                runs.setdefault(label, []).append(got)
    results = [combine(label, runs[label]) for label in TARGETS if label in runs]
    return f"{model}; {workload.shape}; {vllm_router_version(vllm)}", results


def add_live_args(p: argparse.ArgumentParser, positive: Any) -> None:
    g = p.add_argument_group("live part")
    g.add_argument(
        "--model", help="checkpoint of every replica (default: the tiny demo checkpoint)"
    )
    g.add_argument("--live-replicas", type=positive, default=2, help="kvserve serve replicas")
    g.add_argument("--conversations", type=positive, default=16, help="chats")
    g.add_argument("--turns", type=positive, default=4, help="turns per chat")
    g.add_argument("--first-turn-tokens", type=positive, default=256, help="first message")
    g.add_argument("--turn-tokens", type=positive, default=32, help="each later message")
    g.add_argument("--max-tokens", type=positive, default=32, help="answer tokens (ignore_eos)")
    g.add_argument("--concurrency", type=positive, default=16, help="clients (chats in flight)")
    g.add_argument("--threads", type=positive, default=1, help="CPU threads of each replica")
    g.add_argument(
        "--rounds",
        type=positive,
        default=1,
        help="run every router this many times, every other round in reverse order; "
        "latencies over all rounds, cached tokens per round",
    )
    g.add_argument("--engine-args", default="", help="more `kvserve serve` flags per replica")
    g.add_argument(
        "--vllm-router",
        metavar="PATH",
        help=f"vllm-router executable (default: on PATH, else {VLLM_ROUTER_DIR}/bin)",
    )
