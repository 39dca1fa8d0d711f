"""The KV cache's answer for one step: what the runner must do with one request's KV.

These are the only kvcache types (with the specs) that the model room, the
offload connector and the content tracker read. They are plain data: block
ids, positions and page numbers, built when the slots are allocated and
never changed afterwards, so no reader needs to know how groups, hits,
copies or snapshots are implemented.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass(slots=True, frozen=True)
class CopyOp:
    """Copy `num_tokens` K/V slots of one group from block to block, before the step.

    Copy-on-write of a prefix hit that ends inside a cached physical block
    (hybrid models with inflated attention blocks).
    """

    group: int
    src_block: int
    src_offset: int
    dst_block: int
    dst_offset: int
    num_tokens: int


@dataclass(slots=True)
class StatePlan:
    """What the runner does with one request's state in one step, for one state group.

    Read the state from page `state_in` (0: start from zeros), run the chunk,
    write the final state to `state_out`, and after the first k tokens of the
    chunk also write the state to page p for each (k, p) in `snapshots`.
    """

    state_in: int
    state_out: int
    snapshots: list[tuple[int, int]] = field(default_factory=list)


class StepPlan(NamedTuple):
    """One scheduled request's KV work in one step (immutable).

    The runner computes positions [start, start + num_tokens): it writes
    their K/V into the slots `block_ids` gives them (except below
    `skip_write_until`, whose K/V already sits in shared blocks), after doing
    `copies`, and runs each state group as its `state_plans` entry says. A
    named tuple: built once per request per step on the scheduler's hot path,
    and nobody can change it afterwards.
    """

    request_id: str
    block_ids: tuple[tuple[int, ...], ...]
    """Per KV cache group, the block table covering [0, start + num_tokens); 0 is the
    null block (a sliding window's released blocks), never read. The manager hands the
    same tuples out again while a table does not change."""
    start: int
    num_tokens: int
    skip_write_until: int = 0
    """Positions below this hold their K/V in shared blocks already: read, never written
    (a fully cached prompt recomputes its last token only for its logits)."""
    copies: tuple[CopyOp, ...] = ()
    """Copy-on-write of a partial hit: done before the forward."""
    state_plans: tuple[StatePlan | None, ...] | None = None
    """Per group: a state group's plan, None for attention; None without state groups."""
    num_cacheable_blocks: int = 0
    """Leading hash blocks whose K/V may be offered to external tiers after this step
    (0 with prefix caching off or after a hash collision broke the chain)."""
    num_lookahead_tokens: int = 0
    """The last positions of [start, end) are draft tokens (speculative decoding): their
    slots are written and read by this step's later positions, but their K/V counts only
    once the engine accepts them; their blocks are never registered for them."""

    @property
    def end(self) -> int:
        return self.start + self.num_tokens
