"""The model runner's check of one scheduled chunk before a step: a malformed plan is a
ValueError naming its request, never a wrong read or write of another request's slots."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvserve.batch import SeqChunk


class RunnerShape(Protocol):
    """What the check reads of the runner (kvserve.model.runner.ModelRunner): a protocol, so
    the runner imports this module and not the other way round."""

    vocab_size: int
    num_blocks: int
    block_size: int

    @property
    def kv_cache_specs(self) -> Sequence[object]: ...

    @property
    def state_groups(self) -> Sequence[int]: ...


def check_chunk(runner: RunnerShape, chunk: SeqChunk) -> None:
    """Reject a malformed chunk with a message that names the request."""
    plan = chunk.plan
    rid = chunk.request_id
    if plan.start < 0:
        raise ValueError(f"request {rid}: negative start_pos {plan.start}")
    ids = chunk.new_token_ids
    if not ids or plan.num_tokens < 1:
        raise ValueError(f"request {rid}: a chunk needs at least one token")
    if len(ids) != plan.num_tokens:
        raise ValueError(f"request {rid}: the plan covers tokens the request does not have")
    if min(ids) < 0 or max(ids) >= runner.vocab_size:
        raise ValueError(f"request {rid}: token ids must be in [0, {runner.vocab_size})")
    end = plan.end
    if len(plan.block_ids) != len(runner.kv_cache_specs):
        raise ValueError(
            f"request {rid}: {len(plan.block_ids)} block tables for "
            f"{len(runner.kv_cache_specs)} KV cache groups"
        )
    if runner.state_groups:
        plans = plan.state_plans
        if plans is None or len(plans) != len(runner.kv_cache_specs):
            raise ValueError(f"request {rid}: state groups need state plans")
        for g in runner.state_groups:
            state = plans[g]
            if state is None or not state.state_out:
                raise ValueError(f"request {rid}: group {g} has no state page")
            pages = [state.state_in, state.state_out, *(p for _, p in state.snapshots)]
            if any(p < 0 or p >= runner.num_blocks for p in pages):
                raise ValueError(f"request {rid}: state pages must be in [0, {runner.num_blocks})")
    for g, table in enumerate(plan.block_ids):
        if g in runner.state_groups:
            continue
        if len(table) * runner.block_size < end:
            raise ValueError(
                f"request {rid}: block table of {len(table)} blocks "
                f"cannot hold {end} tokens (block size {runner.block_size})"
            )
        if any(b < 0 or b >= runner.num_blocks for b in table):
            raise ValueError(f"request {rid}: block ids must be in [0, {runner.num_blocks})")
