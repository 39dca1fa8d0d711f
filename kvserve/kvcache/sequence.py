"""The KV cache manager's record of one request: its hashes and the blocks it holds."""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter

from kvserve.kvcache.block import KVBlock
from kvserve.kvcache.hashing import pack_tokens
from kvserve.kvcache.plan import CopyOp, StatePlan

_block_id = attrgetter("block_id")


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
    packed_tokens: bytearray = field(default_factory=bytearray)
    """The leading tokens as hashed (hashing.pack_tokens, 4 bytes a token), kept from
    hashing: what a block registered for them keeps, what a hit is verified against."""
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
    """This step's copy-on-write operations (the step plan hands them to the runner)."""
    step_start: int = 0
    """First position computed by the step being scheduled (its plan's `start`)."""
    step_tokens: int = 0
    """Scheduled positions it computes (its plan's `num_tokens` less the lookahead)."""
    step_lookahead: int = 0
    """Draft positions after them that have slots too (its plan's `num_lookahead_tokens`)."""
    slot_end: int = 0
    """End of the last allocation's slots, lookahead included: blocks past the computed
    tokens hold only draft slots, never registered (check_invariants, 6)."""
    table_ids: list[tuple[int, ...]] = field(default_factory=list)
    """Per group, the block ids of `kv_blocks` as last handed out in a plan: tables
    mostly grow at the end, so a plan extends this instead of rebuilding it."""
    plan_ids: tuple[tuple[int, ...], ...] = ()
    """`table_ids` as one tuple, handed out in every plan until a table changes; ()
    after a change (whoever changes `kv_blocks` resets it)."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def packed_through(self, end: int, block_size: int) -> bytearray:
        """`packed_tokens` covering hash blocks 0..end-1 at least (whatever hashing
        did not pack, hashes extended by someone else, is packed here)."""
        packed = self.packed_tokens
        have = len(packed) // 4
        if have < end * block_size:
            packed += pack_tokens(self.token_ids[have : end * block_size])
        return packed

    def packed_blocks(self, start: int, end: int, block_size: int) -> bytes:
        """The packed tokens of hash blocks `start..end-1`."""
        width = 4 * block_size
        return bytes(self.packed_through(end, block_size)[start * width : end * width])

    def table_changed(self, group: int) -> None:
        """An entry of group `group`'s table was replaced (not just appended)."""
        self.table_ids[group] = ()
        self.plan_ids = ()

    def rebuild_block_ids(self) -> tuple[tuple[int, ...], ...]:
        """The tables' ids after a change (every change resets `plan_ids`): tables
        mostly grow at the end, so each group's ids are extended, not rebuilt."""
        cached = self.table_ids
        for group, table in enumerate(self.kv_blocks):
            ids = cached[group]
            if len(ids) != len(table):
                cached[group] = ids + tuple(map(_block_id, table[len(ids) :]))
        self.plan_ids = tuple(cached)
        return self.plan_ids

    @property
    def holds_blocks(self) -> bool:
        return any(self.kv_blocks) or bool(self.merges) or bool(self.transient)
