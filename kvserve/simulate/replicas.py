"""`simulate --replicas N`: N engines behind a router, and one pool of N times the blocks.

Each replica is the whole single-engine simulation (its own scheduler, KV
cache manager and pool of `num_blocks`); the router (`SimRouter`) sees them
only through their events and outputs. Arrivals follow the workload (a
follow-up turn arrives the step after its previous turn finished, wherever
that ran); each step the router routes what has arrived, then every replica
with work runs one step. The same workload then runs on one engine with N
times the blocks: what the replicas' prefill is measured against.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections import deque
from collections.abc import Callable

from kvserve.engine.llm_engine import LLMEngine
from kvserve.routing import make_policy
from kvserve.sampling_params import RequestOutputKind
from kvserve.simulate.router import ReplicaCounts, SimRouter
from kvserve.simulate.simulator import (
    SimConfig,
    ample_blocks,
    arrival_queue,
    check_drained,
    make_engine,
    report_header,
    sim_params,
    simulate,
    step_engine,
)
from kvserve.simulate.workloads import SimRequest, Workload

SINGLE_POOL_KEYS = (
    "num_blocks",
    "prefill_tokens_computed",
    "ideal_prefill_tokens",
    "prefix_hit_tokens",
    "hit_rate",
    "preemptions",
    "evictions",
    "steps",
)
"""What the report keeps of the single-pool run."""


def simulate_replicas(
    workload: Workload,
    config: SimConfig,
    replicas: int,
    routing: str = "cache-aware",
    progress: Callable[[int], object] | None = None,
) -> dict:
    """Route `workload` over `replicas` model-free engines with the policy `routing`;
    the report, per replica and in total, with the single-pool run beside it."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if config.kv_events_config is not None:
        raise ValueError("KV events are published for one engine: use them with one replica")
    if config.offload:
        raise ValueError(
            "external tiers with several replicas: the router predicts device-pool hits only"
        )
    policy = make_policy(routing)
    num_blocks = config.num_blocks or ample_blocks(workload, config.block_size, len(config.groups))
    engines = [make_engine(config, num_blocks) for _ in range(replicas)]
    router = SimRouter(policy, [e.manager for e in engines])
    wall0 = time.perf_counter()
    run = _Run(workload, config, engines, router, progress)
    try:
        run.loop()
    finally:
        for engine in engines:
            engine.shutdown()
    wall = time.perf_counter() - wall0
    if config.check:
        for engine in engines:
            check_drained(engine)
    single = simulate(
        workload,
        dataclasses.replace(config, num_blocks=config.num_blocks and num_blocks * replicas),
    )
    per_replica = [
        _replica(engine, counts) for engine, counts in zip(engines, router.counts, strict=True)
    ]
    total = {key: sum(r[key] for r in per_replica) for key in per_replica[0] if key != "hit_rate"}
    prompt = sum(c.first_prompt_tokens for c in router.counts)
    computed = [r["prefill_tokens_computed"] for r in per_replica]
    mean = sum(computed) / len(computed)
    return {
        **report_header(workload, config, num_blocks),
        "replicas": replicas,
        "routing": policy.name,
        **total,
        "requests": run.requests,
        "rejected": run.rejected,
        "hit_rate": total["prefix_hit_tokens"] / prompt if prompt else 0.0,
        "load_balance": max(computed) / mean if mean else 1.0,
        "held_requests": len(run.held),
        "generated_tokens": run.generated,
        "steps": run.step,
        "per_replica": per_replica,
        "single_pool": {key: single[key] for key in SINGLE_POOL_KEYS},
        "prefill_vs_single_pool": (
            total["prefill_tokens_computed"] / single["prefill_tokens_computed"]
            if single["prefill_tokens_computed"]
            else 1.0
        ),
        "wall_seconds": wall,
        "errors": run.errors[:20],
    }


def _replica(engine: LLMEngine, counts: ReplicaCounts) -> dict:
    """One replica's line: the engine's counters and the router's view of its hits."""
    s = engine.scheduler.stats
    first = counts.first_prompt_tokens
    return {
        "requests": counts.requests,
        "prompt_tokens": s.prompt_tokens,
        "prefill_tokens_computed": s.prefill_tokens_computed,
        "prefix_hit_tokens": counts.first_hit_tokens,
        "hit_rate": counts.first_hit_tokens / first if first else 0.0,
        "readmission_hit_tokens": s.prefix_hit_tokens - counts.first_hit_tokens,
        "preemptions": s.preemptions,
        "evictions": engine.manager.pool.num_evictions,
        "peak_blocks_used": engine.manager.stats.peak_blocks_used,
        "predictions_exact": counts.exact,
        "predictions_wrong": counts.wrong,
        "predictions_hit_less": counts.hit_less,
    }


class _Run:
    """The arrival loop over several engines (the single-engine `_run`, routed)."""

    def __init__(
        self,
        workload: Workload,
        config: SimConfig,
        engines: list[LLMEngine],
        router: SimRouter,
        progress: Callable[[int], object] | None,
    ) -> None:
        self.workload = workload
        self.config = config
        self.engines = engines
        self.router = router
        self.progress = progress
        self.arrivals = arrival_queue(workload)
        self.order = len(self.arrivals)
        self.queue: deque[SimRequest] = deque()
        """Arrived, not yet sent (waiting for an in-flight prefix)."""
        self.source: dict[str, tuple[int, SimRequest]] = {}
        """Request id -> (sent order, request) until it finishes."""
        self.sent = 0
        self.requests = self.rejected = self.generated = self.step = 0
        self.errors: list[str] = []
        self.held: set[str] = set()
        """Requests that waited for an in-flight request sharing their prefix."""

    def busy(self) -> bool:
        return any(e.has_unfinished_requests() for e in self.engines)

    def loop(self) -> None:
        while self.arrivals or self.queue or self.busy():
            if not self.queue and not self.busy() and self.arrivals[0][0] > self.step:
                self.step = self.arrivals[0][0]
            while self.arrivals and self.arrivals[0][0] <= self.step:
                self.queue.append(heapq.heappop(self.arrivals)[2])
                self.requests += 1
            self.dispatch()
            if self.queue and not self.busy():
                raise RuntimeError(f"step {self.step}: requests wait for nothing in flight")
            done: list[tuple[int, SimRequest, list[int]]] = []
            for replica, engine in enumerate(self.engines):
                if engine.has_unfinished_requests():
                    done.extend(self.step_replica(replica, engine))
            # In the order they were sent, as one engine finishes them in admission order.
            for _, sim_req, tokens in sorted(done, key=lambda d: d[0]):
                self.finished(sim_req, tokens)
            if self.progress is not None and done:
                self.progress(len(done))
            self.step += 1

    def dispatch(self) -> None:
        """Send every queued request the router can route now, in arrival order."""
        waiting: deque[SimRequest] = deque()
        while self.queue:
            sim_req = self.queue.popleft()
            prompt = list(sim_req.prompt_token_ids)
            choice = self.router.choose(prompt)
            if choice is None:
                waiting.append(sim_req)
                self.held.add(sim_req.request_id)
                continue
            params = sim_params(sim_req, RequestOutputKind.DELTA)
            try:
                if sim_req.request_id in self.source:  # on another replica: one id, one request
                    raise ValueError(f"request id {sim_req.request_id!r} is already in use")
                self.engines[choice.replica].add_request(sim_req.request_id, prompt, params)
            except ValueError as exc:
                self.rejected += 1
                self.errors.append(str(exc))
                continue
            self.router.sent_to(sim_req.request_id, prompt, choice)
            self.source[sim_req.request_id] = (self.sent, sim_req)
            self.sent += 1
        self.queue = waiting

    def step_replica(
        self, replica: int, engine: LLMEngine
    ) -> list[tuple[int, SimRequest, list[int]]]:
        """One step of one replica, its events to the router; (sent order, request,
        output tokens) of each request that finished."""
        outputs = step_engine(engine, self.step, self.config.check)
        self.router.collect(replica)
        done = []
        for output in outputs:
            tokens = self.router.received(output)
            if tokens is not None:
                done.append((*self.source.pop(output.request_id), tokens))
        return done

    def finished(self, sim_req: SimRequest, tokens: list[int]) -> None:
        self.generated += len(tokens)
        if self.workload.follow_up is not None:
            nxt = self.workload.follow_up(sim_req, tokens, self.step)
            if nxt is not None:
                heapq.heappush(self.arrivals, (nxt.arrival_step, self.order, nxt))
                self.order += 1
