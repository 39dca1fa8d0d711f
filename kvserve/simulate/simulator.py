"""The simulation loop and its report."""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvserve.engine.engine_args import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.model_free_runner import ModelFreeRunner
from kvserve.engine.scheduler import Scheduler
from kvserve.kvcache.invariants import check_invariants
from kvserve.kvcache.specs import inflate_for_state, spec_from_name
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import RequestOutputKind, SamplingParams
from kvserve.simulate.workloads import SimRequest, Workload

DEFAULT_MAX_BLOCKS = 1_000_000
"""Cap on the default ("ample") pool: a long trace would otherwise ask for millions."""


@dataclass(slots=True)
class SimConfig:
    block_size: int = 16
    num_blocks: int | None = None
    """None: enough that nothing is ever evicted (capped at DEFAULT_MAX_BLOCKS)."""
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    hash_fn: str = "sha256"
    hash_seed: int = 0
    verify_hits: bool = True
    check: bool = False
    """Verify every design.md invariant after every step (slow)."""
    groups: tuple[str, ...] = ("full",)
    """KV cache groups: 'full' or 'sliding:<window>' each (see MODEL_SPECS)."""
    kv_events_config: Any = None
    """Publish KV cache events (a KVEventsConfig, its dict or JSON; None: off)."""
    kv_events_linger: float = 0.0
    """Seconds to keep serving replay and snapshots after the run (for watchers)."""
    offload: str | None = None
    """External KV tiers below the pool, as the engine's `offload` (cpu:<size>,
    disk:<dir>:<size>); None: off."""
    kv_bytes_per_token: int = 4
    """With `offload`: bytes a token's K/V takes in each group (tier sizes count these).
    4 is the token id itself, the model-free K/V; a real model's size makes the tiers
    hold as many bytes, in this process's memory and on disk."""


MODEL_SPECS: dict[str, tuple[str, ...]] = {
    "full": ("full",),
    "gemma3-like": ("full", "sliding:1024", "sliding:1024"),
    "mamba-hybrid-like": ("full", "mamba:4", "mamba:4", "mamba:4"),
}
"""Group layouts `simulate --model-spec` knows: the hybrid coordinator without torch.
gemma3-like: Gemma 3's interleaved global and local (1024-token window) layers,
grouped as one full-attention group and two sliding-window groups.
mamba-hybrid-like: a Bamba-style model, one attention group and three Mamba2
state groups whose state page is 4 hash blocks of K/V, so attention blocks are
inflated to 4 hash blocks and state snapshots are taken every 4."""


def ample_blocks(workload: Workload, block_size: int, num_groups: int = 1) -> int:
    reqs = len(workload.requests)
    need = workload.max_total_tokens // block_size + 2 * max(reqs, 1) + 1
    return min(need * num_groups, DEFAULT_MAX_BLOCKS)


def make_engine(config: SimConfig, num_blocks: int, *, kv_events: bool = False) -> LLMEngine:
    """An engine over the model-free runner with `num_blocks` blocks (the config's
    event publisher only with `kv_events`)."""
    specs = inflate_for_state([spec_from_name(g, config.block_size) for g in config.groups])
    kv_bytes = config.kv_bytes_per_token if config.offload else None
    runner = ModelFreeRunner(specs, num_blocks, config.block_size, kv_bytes_per_token=kv_bytes)
    return LLMEngine.from_runner(
        runner,
        EngineArgs(
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_prefix_caching=config.enable_prefix_caching,
            hash_fn=config.hash_fn,
            hash_seed=config.hash_seed,
            kv_events_config=config.kv_events_config if kv_events else None,
            offload=config.offload,
        ),
        verify_hits=config.verify_hits,
    )


def arrival_queue(workload: Workload) -> list[tuple[int, int, SimRequest]]:
    """The workload's requests as a heap of (arrival step, order, request)."""
    arrivals = [(r.arrival_step, order, r) for order, r in enumerate(workload.requests)]
    heapq.heapify(arrivals)
    return arrivals


def sim_params(sim_req: SimRequest, kind: RequestOutputKind) -> SamplingParams:
    """Greedy sampling of `max_tokens` tokens, outputs of `kind`."""
    return SamplingParams(max_tokens=sim_req.max_tokens, temperature=0.0, output_kind=kind)


def step_engine(engine: LLMEngine, step: int, check: bool) -> list[RequestOutput]:
    """One engine step; RuntimeError if it could schedule nothing. `check`: verify
    every design.md invariant afterwards."""
    outputs = engine.step()
    if engine.connector is not None:
        engine.connector.store.flush()  # a step's disk writes land within it: reproducible
    scheduler = engine.scheduler
    if not engine.last_step_num_chunks:
        raise RuntimeError(
            f"step {step}: nothing could be scheduled "
            f"({len(scheduler.waiting)} waiting, {len(scheduler.running)} running)"
        )
    if check:
        held = scheduler.running
        check_invariants(engine.manager, {r.request_id: r.num_computed_tokens for r in held})
    return outputs


def check_drained(engine: LLMEngine) -> None:
    """After a run: the invariants hold and no block is held any more."""
    manager = engine.manager
    check_invariants(manager, {})
    if manager.pool.num_used:
        raise AssertionError(f"{manager.pool.num_used} blocks still used after the run")


def report_header(workload: Workload, config: SimConfig, num_blocks: int) -> dict:
    """What ran: the workload, its parameters, and the KV cache every engine had."""
    return {
        "workload": workload.name,
        "params": workload.params,
        "block_size": config.block_size,
        "groups": list(config.groups),
        "num_blocks": num_blocks,
        "prefix_caching": config.enable_prefix_caching,
        "hash": config.hash_fn,
    }


def simulate(
    workload: Workload,
    config: SimConfig,
    progress: Callable[[int], object] | None = None,
    before_step: Callable[[Scheduler, Any], None] | None = None,
) -> dict:
    """Run `workload` to completion through the engine's step loop; the report.

    The engine runs the model-free runner, so everything but the model is
    the real thing: scheduler, KV cache manager, stop checks, events.
    `before_step(scheduler, kv_events)` runs before each step is scheduled,
    with the step's arrivals already waiting (tests compare a subscriber's
    view there).
    """
    num_blocks = config.num_blocks or ample_blocks(workload, config.block_size, len(config.groups))
    engine = make_engine(config, num_blocks, kv_events=True)
    try:
        return _run(workload, config, engine, num_blocks, progress, before_step)
    finally:
        if engine.kv_events is not None:
            time.sleep(config.kv_events_linger)
        engine.shutdown()


def _run(
    workload: Workload,
    config: SimConfig,
    engine: LLMEngine,
    num_blocks: int,
    progress: Callable[[int], object] | None,
    before_step: Callable[[Scheduler, Any], None] | None,
) -> dict:
    """Arrivals by step, one engine step each, follow-up turns as answers finish."""
    scheduler = engine.scheduler
    manager = engine.manager
    arrivals = arrival_queue(workload)
    order = len(arrivals)
    source: dict[str, SimRequest] = {}
    requests = rejected = generated = 0
    errors: list[str] = []
    step = 0
    wall0 = time.perf_counter()
    while arrivals or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests() and arrivals[0][0] > step:
            step = arrivals[0][0]
        while arrivals and arrivals[0][0] <= step:
            sim_req = heapq.heappop(arrivals)[2]
            requests += 1
            params = sim_params(sim_req, RequestOutputKind.FINAL_ONLY)
            try:
                engine.add_request(sim_req.request_id, list(sim_req.prompt_token_ids), params)
            except ValueError as exc:
                rejected += 1
                errors.append(f"request {sim_req.request_id}: {exc}")
                continue
            source[sim_req.request_id] = sim_req
        if not engine.has_unfinished_requests():
            step += 1  # every arrival of this step was rejected
            continue
        if before_step is not None:
            before_step(scheduler, engine.kv_events)
        outputs = step_engine(engine, step, config.check)
        finished = 0
        for output in outputs:
            if not output.finished:
                continue
            finished += 1
            tokens = output.outputs[0].token_ids
            generated += len(tokens)
            sim_req = source.pop(output.request_id)
            if workload.follow_up is not None:
                nxt = workload.follow_up(sim_req, tokens, step)
                if nxt is not None:
                    heapq.heappush(arrivals, (nxt.arrival_step, order, nxt))
                    order += 1
        if progress is not None and finished:
            progress(finished)
        step += 1
    wall = time.perf_counter() - wall0
    if config.check:
        check_drained(engine)
    s = scheduler.stats
    tracker = engine.tracker
    hit_total = s.prefix_hit_tokens + s.prefill_tokens_computed
    return {
        **report_header(workload, config, num_blocks),
        "requests": requests,
        "rejected": rejected,
        "prompt_tokens": s.prompt_tokens,
        "ideal_prefill_tokens": tracker.ideal_prefill_tokens,
        "prefill_tokens_computed": s.prefill_tokens_computed,
        "prefix_hit_tokens": s.prefix_hit_tokens,
        "hit_rate": s.prefix_hit_tokens / hit_total if hit_total else 0.0,
        "peak_blocks_used": manager.stats.peak_blocks_used,
        "duplicate_blocks_peak": tracker.duplicates_peak,
        "evictions": manager.pool.num_evictions,
        "preemptions": s.preemptions,
        "steps": s.steps,
        "generated_tokens": generated,
        "manager_seconds": s.manager_seconds,
        "manager_us_per_prompt_token": (
            1e6 * s.manager_seconds / s.prompt_tokens if s.prompt_tokens else 0.0
        ),
        "wall_seconds": wall,
        "errors": errors[:20],
        **(_offload_report(engine, config) if config.offload else {}),
    }


def _offload_report(engine: LLMEngine, config: SimConfig) -> dict:
    runner = engine.runner
    assert isinstance(runner, ModelFreeRunner) and runner.kv is not None  # kept for the tiers
    stats = engine.stats_dict()
    keys = ("offload_bytes_loaded", "offload_bytes_saved", "offload_dropped_writes")
    return {
        "offload": config.offload,
        "kv_bytes_per_token": config.kv_bytes_per_token,
        "external_hit_tokens": stats["external_hit_tokens"],
        **{key: stats[key] for key in keys},
        "kv_positions_checked": runner.kv.checked_positions,
    }
