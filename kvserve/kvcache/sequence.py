"""The KV cache manager's record of one request: its hashes and the blocks it holds."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.kvcache.block import KVBlock
from kvserve.kvcache.plan import CopyOp, StatePlan


@dataclass(slots=True, eq=False)
class CacheSequence:
    """Per request, everything the manager tracks; only the manager writes it.

    `token_ids` is the request's own token list, read here and appended to
    only by the request's owner (the scheduler), so generated tokens need no
    second copy. Everything else belongs to the manager, which keeps these
    records keyed by request id (`KVCacheManager.sequence` shows one to
    tests and the invariant checker).
    """

    request_id: str
    token_ids: list[int]
    lora_name: str | None = None
    cache_salt: str | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    """One chained hash per full hash block, extended as tokens are added."""
    extra_keys: tuple[bytes, bytes] = (b"", b"")
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
    copies: list[CopyOp] = field(default_factory=list)
    """This step's copy-on-write operations, handed to the runner in the step plan."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def holds_blocks(self) -> bool:
        return any(self.kv_blocks) or bool(self.merges) or bool(self.transient)
