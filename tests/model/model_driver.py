"""A minimal scheduler loop for the tests: real block tables from KVCacheManager.

It exercises exactly what the engine will: prefix lookup, atomic slot
allocation (with pending-block sharing inside a step), chunked prefill,
decode, end_step and free, around `ModelRunner.execute`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.batch import SeqChunk, TokenLogprobs
from kvserve.kvcache import KVCacheConfig, KVCacheManager, StepPlan
from kvserve.model import ModelRunner
from kvserve.sampling_params import SamplingParams

NEW = 10
"""Tokens generated per request in the oracle tests."""


def prompt(length: int, salt: int = 0) -> list[int]:
    """A deterministic prompt of random token ids (all below the tiny vocab of 320)."""
    gen = torch.Generator().manual_seed(1000 * salt + length)
    return torch.randint(3, 300, (length,), generator=gen).tolist()


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams | None = None
    arrival_step: int = 0
    token_ids: list[int] = field(init=False)
    num_computed: int = 0
    output: list[int] = field(default_factory=list)
    hit_tokens: int = 0
    """Prompt tokens found in the prefix cache (shared, not recomputed)."""
    skipped_writes: int = 0
    """skip_write_until of the step plans: the fully cached prompt case."""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    """What the runner reported per generated token (params.logprobs set)."""
    done: bool = False

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt)


@dataclass
class Driver:
    runner: ModelRunner
    chunk_size: int | None = None
    """Most prompt tokens one request computes per step (None = whole prompt)."""
    enable_prefix_caching: bool = True
    manager: KVCacheManager = field(init=False)
    steps: int = 0

    def __post_init__(self) -> None:
        config = KVCacheConfig(
            num_blocks=self.runner.num_blocks,
            block_size=self.runner.block_size,
            enable_prefix_caching=self.enable_prefix_caching,
            specs=self.runner.kv_cache_specs,
        )
        self.manager = KVCacheManager(config)

    def run(self, requests: list[Request]) -> list[list[int]]:
        """Step until every request is done; each request's generated tokens."""
        pending = sorted(requests, key=lambda r: r.arrival_step)
        active: list[Request] = []
        while pending or active:
            while pending and pending[0].arrival_step <= self.steps:
                request = pending.pop(0)
                self.manager.add_request(request.request_id, request.token_ids)
                active.append(request)
            if active:
                self.step(active)
            active = [r for r in active if not r.done]
            self.steps += 1
        return [r.output for r in requests]

    def step(self, requests: list[Request]) -> None:
        m = self.manager
        scheduled: list[tuple[Request, int]] = []
        chunks = []
        for r in requests:
            hit = m.get_computed_blocks(r.request_id, r.num_computed)
            if hit.num_tokens:
                r.hit_tokens += hit.num_tokens
                r.num_computed += hit.num_tokens
            remaining = len(r.token_ids) - r.num_computed
            num_new = remaining if self.chunk_size is None else min(remaining, self.chunk_size)
            assert num_new >= 1
            assert m.allocate_slots(r.request_id, num_new, r.num_computed, hit), "pool too small"
            plan = m.step_plan(r.request_id)
            r.skipped_writes = max(r.skipped_writes, plan.skip_write_until)
            scheduled.append((r, num_new))
            sample = r.num_computed + num_new == len(r.token_ids)
            chunks.append(
                SeqChunk(
                    r.request_id, r.token_ids, plan, sample, r.params, num_generated=len(r.output)
                )
            )
        step = self.runner.execute(chunks)
        m.end_step()
        found = step.logprobs or [None] * len(chunks)
        for (r, n), token, logprobs in zip(scheduled, step.tokens, found, strict=True):
            r.num_computed += n
            if token is None:
                continue
            if logprobs is not None:
                r.logprobs.append(logprobs)
            r.output.append(token)
            r.token_ids.append(token)
            stop = token in self.runner.eos_token_ids and not (r.params and r.params.ignore_eos)
            if stop or len(r.output) >= r.max_new_tokens:
                r.done = True
                m.remove_request(r.request_id)
                self.runner.free_request(r.request_id)


def generate(
    runner: ModelRunner,
    prompts: list[list[int]],
    max_new_tokens: int,
    **driver_kwargs,
) -> list[list[int]]:
    """Greedy tokens for prompts that all arrive at step 0."""
    requests = [Request(f"r{i}", p, max_new_tokens) for i, p in enumerate(prompts)]
    return Driver(runner, **driver_kwargs).run(requests)


def make_chunk(
    request_id: str,
    token_ids: list[int],
    start_pos: int,
    block_tables: list[list[int]],
    *,
    skip_write_until: int = 0,
    **kwargs,
) -> SeqChunk:
    """A runner chunk computing `token_ids` at `start_pos` with these block tables."""
    plan = StepPlan(request_id, block_tables, start_pos, len(token_ids), skip_write_until)
    earlier = [0] * max(0, start_pos)  # positions before the chunk: never read by the runner
    return SeqChunk(request_id, earlier + list(token_ids), plan, **kwargs)
