"""The KV cache's view of one request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.kvcache.block import KVBlock

if TYPE_CHECKING:
    from kvserve.kvcache.state_group import StatePlan


@dataclass(slots=True, eq=False)
class CacheSequence:
    """Token ids plus the cache state the manager keeps per request.

    The engine's request extends this class. `token_ids` grows as tokens are
    generated; `block_hashes` follows it one full hash block at a time. The
    fields after `extra_keys` belong to the manager: nothing else writes them.
    """

    request_id: str
    token_ids: list[int]
    lora_name: str | None = None
    cache_salt: str | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    extra_keys: tuple[bytes, bytes] = (b"", b"")
    # Manager-owned state.
    kv_blocks: list[list[KVBlock]] = field(default_factory=list)
    """Per group, the physical blocks of this request's block table."""
    num_cached_blocks: int = 0
    """Leading full blocks already registered in the prefix index (or merged)."""
    cache_chain_broken: bool = False
    """A hash collision blocked registration; later blocks are never registered."""
    merges: list[tuple[int, int, KVBlock]] = field(default_factory=list)
    """(group, block index, cached copy) to swap in after the step: late merges."""
    skip_write_tokens: int = 0
    """Tokens whose KV already sits in shared blocks (fully cached prompt)."""
    num_skipped_blocks: list[int] = field(default_factory=list)
    """Per group, leading table entries released to the null block (sliding window)."""
    transient: list[KVBlock] = field(default_factory=list)
    """Blocks held for the step being scheduled only: copy-on-write sources, the
    snapshot a state hit resumes from, snapshots being written."""
    state_plans: list[StatePlan | None] = field(default_factory=list)
    """Per group (None for attention): this step's state plan for the runner."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)
