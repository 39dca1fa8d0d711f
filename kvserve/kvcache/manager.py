"""The manager facade the scheduler talks to.

It owns one record per request (`CacheSequence`, keyed by request id, as
vLLM's managers keep `req_to_blocks`) and answers each allocation with a
`StepPlan`: plain block ids and positions for the runner. How groups find
hits, share blocks, copy or snapshot stays behind the coordinator it picks
once, when it is built (coordinator.py, state_coordinator.py).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.config import KVCacheConfig
from kvserve.kvcache.coordinator import AttentionCoordinator, KVCacheStats, PrefixHit
from kvserve.kvcache.event_sink import KVEventSink
from kvserve.kvcache.hashing import extra_key_bytes
from kvserve.kvcache.plan import StepPlan
from kvserve.kvcache.sequence import CacheSequence
from kvserve.kvcache.specs import FullAttentionSpec, MambaStateSpec
from kvserve.kvcache.state_coordinator import StateCoordinator


class KVCacheManager:
    """Longest cached prefix, slots for exactly the scheduled tokens, free.

    Every method either fully succeeds or changes nothing. The scheduler owns
    token counts and appends generated tokens to the list it gave
    `add_request`; the manager owns blocks and hashes.
    """

    def __init__(self, config: KVCacheConfig) -> None:
        specs = config.specs or [FullAttentionSpec(block_size=config.block_size)]
        self.config = config
        self.block_size = config.block_size
        """The hash block size: the unit of matching (physical blocks may be larger)."""
        self.enable_caching = config.enable_prefix_caching
        self.pool = BlockPool(config.num_blocks, num_groups=len(specs))
        has_state = any(isinstance(spec, MambaStateSpec) for spec in specs)
        self._has_state = has_state
        self.coordinator = self._coordinator_type(has_state)(config, self.pool, specs)
        self.groups = self.coordinator.groups
        self.hasher = self.coordinator.hasher
        self.stats: KVCacheStats = self.coordinator.stats
        # Bound once: no flag checks on the hot path.
        self._lookup = self.coordinator.lookup
        self._allocate = self.coordinator.allocate
        self._in_place_decodes = self.coordinator.in_place_decodes
        self._seqs: dict[str, CacheSequence] = {}

    @classmethod
    def _coordinator_type(cls, has_state: bool) -> type[AttentionCoordinator | StateCoordinator]:
        """Chosen once per manager (tests substitute a deliberately broken one)."""
        return StateCoordinator if has_state else AttentionCoordinator

    # -- requests ---------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        token_ids: list[int],
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Start tracking a request: extra keys, empty block tables, prompt hashes.

        `token_ids` is kept by reference: its owner appends generated tokens
        to it. A bad token id raises ValueError and nothing is kept.
        """
        old = self._seqs.get(request_id)
        if old is not None and old.holds_blocks:
            raise ValueError(f"request {request_id} is already held by the KV cache")
        seq = CacheSequence(request_id, token_ids, lora_name=lora_name, cache_salt=cache_salt)
        seq.extra_keys = extra_key_bytes(lora_name, cache_salt)
        seq.kv_blocks = [[] for _ in self.groups]
        seq.table_ids = [() for _ in self.groups]
        seq.num_skipped_blocks = [0] * len(self.groups)
        if self.enable_caching:
            self.coordinator.hash(seq)
        # Hashing covers full blocks only: check the rest too, so a bad id fails
        # here and not inside a later allocate_slots (design.md invariant 11).
        rest = token_ids[len(seq.block_hashes) * self.block_size :]
        try:
            struct.pack(f"<{len(rest)}I", *rest)
        except struct.error as exc:
            raise ValueError(
                f"request {request_id}: token ids must be integers in [0, 2**32): {exc}"
            ) from None
        self._seqs[request_id] = seq

    def remove_request(self, request_id: str) -> None:
        """Free its blocks (they stay findable) and forget the request."""
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.coordinator.free(seq)

    def get_computed_blocks(self, request_id: str, num_computed_tokens: int = 0) -> PrefixHit:
        """Longest cached continuation of what the request already holds. No side effects.

        Called at admission (nothing held yet) and again before each further
        prefill chunk that starts on a block boundary (another request may
        have cached the next blocks meanwhile). The hit never covers the last
        token: it is computed for its logits; if every block is cached, its
        write is skipped instead (design.md invariant 5).
        """
        return self._lookup(self._seqs[request_id], num_computed_tokens)

    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        num_computed_tokens: int,
        hit: PrefixHit | None = None,
        num_lookahead_tokens: int = 0,
        num_external_tokens: int = 0,
    ) -> bool:
        """Slots for `num_new_tokens` tokens after the computed ones; `step_plan` describes them.

        `num_computed_tokens` already includes `hit.num_tokens`;
        `num_external_tokens` follow them (loaded from an external tier, so
        they need new blocks too). All or nothing: returns False and changes
        nothing when the pool is short (sliding-window blocks that no token
        reads any more are released first either way). Full blocks whose
        tokens are all scheduled are registered now, as pending, so a request
        admitted later in this same step shares them (design.md invariant 7).
        `num_lookahead_tokens` more slots follow for draft tokens (speculative
        decoding): written by the step, never registered; the engine counts
        the accepted ones as computed, and the next allocation registers a
        block once all its tokens are accepted. Refused (ValueError) with
        state groups: a Mamba state cannot be rewound past a rejected draft.
        """
        seq = self._seqs[request_id]
        start = num_computed_tokens + num_external_tokens
        end = start + num_new_tokens + num_lookahead_tokens
        in_place = (  # a decode token in the block it is filling: every table and hash stays
            self._in_place_decodes
            and hit is None
            and not num_lookahead_tokens
            and not num_external_tokens
            and end <= len(seq.kv_blocks[0]) * self.block_size
            and end // self.block_size <= seq.num_cached_blocks
        )
        if not in_place:
            if num_lookahead_tokens and self._has_state:
                raise ValueError(
                    "draft tokens need state that can be rewound: a Mamba state group's "
                    "running state cannot take lookahead slots"
                )
            if not self._allocate(
                seq,
                num_new_tokens,
                num_computed_tokens,
                hit,
                num_lookahead_tokens,
                num_external_tokens,
            ):
                return False
        seq.step_start = start
        seq.step_tokens = num_new_tokens
        seq.step_lookahead = num_lookahead_tokens
        if end > seq.slot_end:
            seq.slot_end = end
        return True

    def accept_tokens(self, request_id: str, num_computed_tokens: int) -> None:
        """After a verification step: the request's tokens up to `num_computed_tokens`
        (its accepted drafts included, already appended) hold their K/V.

        Blocks they fill are hashed and registered now (pending until
        `end_step`, like any block scheduled in the step), so a rejected
        draft never reaches a hash, an index entry, an event or a tier.
        Call before `end_step`.
        """
        seq = self._seqs[request_id]
        if num_computed_tokens > seq.slot_end or num_computed_tokens > len(seq.token_ids):
            raise ValueError(
                f"request {request_id}: {num_computed_tokens} accepted tokens but slots "
                f"for {seq.slot_end} and {len(seq.token_ids)} tokens"
            )
        self._allocate(seq, 0, num_computed_tokens, None, 0, 0)

    def step_plan(self, request_id: str) -> StepPlan:
        """The request's plan for the step being scheduled: what the runner must do.

        Plain, immutable data (block ids per group, positions, skipped writes,
        copies, state plans), valid from its `allocate_slots` until `end_step`.
        """
        return self.coordinator.plan(self._seqs[request_id])

    def record_query(self, num_tokens: int) -> None:
        """Count prompt tokens offered to the prefix cache (once per admission)."""
        self.stats.query_tokens += num_tokens

    def end_step(self) -> None:
        """After the runner: pending blocks are computed; duplicates merge away."""
        self.coordinator.end_step()

    def free(self, request_id: str) -> None:
        """Return every block of the request (tail first); keep its hashes.

        A preempted request is freed and looked up again later. Only between
        steps: blocks it registered as pending in the step being scheduled may
        already be shared, and must be filled by that step.
        """
        self.coordinator.free(self._seqs[request_id])

    def num_releasable_blocks(self, request_id: str) -> int:
        """Blocks that freeing the request now would return to the free pool: those no
        other request holds (a shared prefix block stays in use). The scheduler's fair
        shares weigh a preemption with it before making one."""
        seq = self._seqs[request_id]
        null = self.pool.null_block
        held = [b for table in seq.kv_blocks for b in table if b is not null]
        held += [copy for _, _, copy in seq.merges]
        held += seq.transient
        return len({b.block_id for b in held if b.ref_cnt == 1})

    def block_ids(self, request_id: str) -> list[list[int]]:
        """Block table per group as it stands now (0: the null block, never read)."""
        seq = self._seqs[request_id]
        return [list(ids) for ids in seq.plan_ids or seq.rebuild_block_ids()]

    def block_hashes(self, request_id: str) -> Sequence[bytes]:
        """The request's block hashes so far (read only; they grow with its tokens)."""
        return self._seqs[request_id].block_hashes

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block; refused (False) while any request holds blocks."""
        return self.pool.reset_prefix_cache()

    def attach_events(self, sink: KVEventSink | None) -> None:
        """Record this manager's events in `sink` (None: stop recording)."""
        if sink is not None:
            if sink.hash_block_size != self.block_size:
                raise ValueError("the sink's hash block size differs from the manager's")
            sink.group_kinds = [(g.kind, getattr(g, "window", None)) for g in self.groups]
        self.pool.events = sink

    # -- introspection ----------------------------------------------------------

    def sequence(self, request_id: str) -> CacheSequence:
        """The manager's record of one request, for tests and the invariant checker only."""
        return self._seqs[request_id]

    def sequences(self) -> list[CacheSequence]:
        """Every request the manager tracks (the invariant checker's view)."""
        return list(self._seqs.values())

    def stats_dict(self) -> dict[str, Any]:
        """Cache counters under stable names (duplicates: see kvcache.invariants)."""
        return {
            "prefix_query_tokens": self.stats.query_tokens,
            "prefix_hit_tokens": self.stats.hit_tokens,
            "blocks_used": self.pool.num_used,
            "peak_blocks_used": self.stats.peak_blocks_used,
            "evictions": self.pool.num_evictions,
            "merged_blocks": self.stats.merges,
        }

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_usable

    def blocks_for_tokens(self, num_tokens: int, max_chunk_tokens: int | None = None) -> int:
        """Most blocks one request of `num_tokens` tokens holds at once, all groups together.

        A sliding window holds only its window plus the chunk being computed.
        """
        return self.coordinator.blocks_for_tokens(num_tokens, max_chunk_tokens)
