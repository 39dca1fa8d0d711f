"""The map's invariants as a checker: tests and `simulate --check` call it.

docs/design.md numbers the invariants; this module checks 1, 2, 3, 6, 7, 12
and 13 on the manager's own records (every request it tracks). 4, 5, 8, 9, 10 and
11 are properties of a sequence of calls, not of one state: tests cover them.
"""

from __future__ import annotations

from kvserve.kvcache.block import CacheEntry, KVBlock
from kvserve.kvcache.hashing import pack_tokens
from kvserve.kvcache.manager import KVCacheManager
from kvserve.kvcache.sequence import CacheSequence


class InvariantError(AssertionError):
    """A design.md invariant does not hold."""


def _holders(manager: KVCacheManager) -> list[CacheSequence]:
    return [seq for seq in manager.sequences() if seq.holds_blocks]


def count_duplicate_blocks(manager: KVCacheManager, num_computed: dict[str, int]) -> int:
    """Physical blocks holding content that another held block also holds.

    Content identity is the chained hash of the computed full block, so this
    counts what an exact cache would store once and we store more than once.
    """
    duplicates = 0
    seqs = _holders(manager)
    for group in manager.groups:
        if group.kind == "mamba":
            continue  # a running state is per request; snapshots are deduplicated by hash
        bs = group.block_size
        k = bs // manager.block_size
        first_holder: dict[bytes, int] = {}
        extra: set[int] = set()
        for seq in seqs:
            table: list[KVBlock] = seq.kv_blocks[group.group_id]
            full = min(num_computed[seq.request_id], len(seq.token_ids)) // bs
            manager.coordinator.hash(seq)
            # Inside a step, a block queued for a late merge already counts as its copy.
            merged = {i: copy for g, i, copy in seq.merges if g == group.group_id}
            for i in range(min(full, len(table))):
                block_id = merged.get(i, table[i]).block_id
                if not block_id:  # the null block: released out of a sliding window
                    continue
                # A chained hash names the whole prefix: the last hash block's stands for the block.
                holder = first_holder.setdefault(seq.block_hashes[(i + 1) * k - 1], block_id)
                if holder != block_id:
                    extra.add(block_id)
        duplicates += len(extra)
    return duplicates


def _holds_cached(blocks: list[KVBlock]) -> bool:
    """Whether any of `blocks` is registered in the index (as a whole, or an entry in it)."""
    return any(b.block_hash is not None or b.entries for b in blocks if b.block_id)


def check_invariants(
    manager: KVCacheManager,
    num_computed: dict[str, int] | None = None,
    *,
    between_steps: bool = True,
) -> None:
    """Raise InvariantError naming the first broken invariant.

    `num_computed`: request id -> computed tokens of every request that
    holds blocks; when given, slots and duplicates are checked too.
    """
    seqs = _holders(manager)
    pool = manager.pool
    bs = manager.block_size
    holders = [0] * len(pool.blocks)
    owner: dict[int, int] = {}
    for seq in seqs:
        for group, table in zip(manager.groups, seq.kv_blocks, strict=True):
            nulls = 0
            for i, block in enumerate(table):
                if block.block_id:
                    holders[block.block_id] += 1
                    # A block belongs to one group: two groups in one block overwrite
                    # each other's K/V (the symptom of vLLM #44409).
                    if owner.setdefault(block.block_id, group.group_id) != group.group_id:
                        raise InvariantError(
                            f"block {block.block_id} is held by groups "
                            f"{owner[block.block_id]} and {group.group_id}"
                        )
                elif group.kind != "sliding_window" or i != nulls:
                    raise InvariantError(f"{seq.request_id}: null block inside a table")
                else:
                    nulls += 1
        for _, _, copy in seq.merges:
            holders[copy.block_id] += 1
        for block in seq.transient:
            holders[block.block_id] += 1
    # 1. ref counts equal holders; the null block is never handed out.
    if holders[0] or pool.null_block.ref_cnt:
        raise InvariantError("null block is held or counted")
    for block in pool.blocks[1:]:
        held_by = holders[block.block_id]
        if block.ref_cnt != held_by:
            raise InvariantError(
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != {held_by} holders"
            )
    # 2. free + used = total; the queue holds exactly the unreferenced blocks, once.
    free_ids = pool.free_block_ids()
    if len(free_ids) != len(set(free_ids)):
        raise InvariantError("a block is in the free queue twice")
    if 0 in free_ids:
        raise InvariantError("null block in the free queue")
    expected_free = {b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0}
    if set(free_ids) != expected_free:
        raise InvariantError("free queue differs from the set of unreferenced blocks")
    if pool.num_free + pool.num_used != pool.num_usable:
        raise InvariantError("free + used != total")
    # 3. index entries describe their blocks; held cached blocks hold the sequence's tokens.
    for group_id, index in enumerate(pool.index):
        for block_hash, entry in index.items():
            # a CacheEntry sits inside an inflated block
            block = entry.block if isinstance(entry, CacheEntry) else entry
            if entry.block_hash != block_hash or entry.group != group_id:
                raise InvariantError(f"index entry for block {block.block_id} is stale")
            if entry is not block and entry not in (block.entries or ()):
                raise InvariantError(f"index entry for block {block.block_id} is not in it")
            if between_steps and not entry.computed:
                raise InvariantError(f"block {block.block_id} still pending between steps")
    for seq in seqs:
        if len(seq.block_hashes) * bs < len(seq.token_ids) - bs + 1:
            manager.coordinator.hash(seq)
        if between_steps and seq.transient:
            raise InvariantError(f"{seq.request_id}: step-only blocks held between steps")
        # 6. hashes are of the token list, which holds accepted tokens only (never a
        # draft): those not yet tied to a registered block are hashed again here.
        fresh = seq.block_hashes[: seq.num_cached_blocks]
        manager.hasher.extend(fresh, seq.token_ids, seq.extra_keys)
        if seq.block_hashes != fresh:
            raise InvariantError(f"{seq.request_id}: a block hash is not its tokens' hash")
        for group, table in zip(manager.groups, seq.kv_blocks, strict=True):
            k = group.block_size // bs
            for m, block in enumerate(table):
                for e in block.entries or ():
                    i = m * k + e.slot
                    if i < len(seq.block_hashes) and e.block_hash != seq.block_hashes[i]:
                        raise InvariantError(
                            f"{seq.request_id}: hash block {i} is cached under another hash"
                        )
        for table in seq.kv_blocks:
            for i, block in enumerate(table):
                if block.block_hash is None or not block.block_id:
                    continue
                if block.block_hash != seq.block_hashes[i]:
                    raise InvariantError(
                        f"{seq.request_id}: block {i} is cached under another prefix's hash"
                    )
                if block.token_ids != pack_tokens(seq.token_ids[i * bs : (i + 1) * bs]):
                    raise InvariantError(
                        f"{seq.request_id}: block {i} tokens differ from its entry"
                    )
    if num_computed is None:
        return
    # 6. slots exist for exactly the computed tokens, and for the draft tokens of the
    # last allocation (kept for the next ones); only accepted tokens' blocks are cached.
    for seq in seqs:
        if seq.request_id not in num_computed:
            raise InvariantError(f"{seq.request_id} holds blocks but is not running")
        computed = num_computed[seq.request_id]
        for group, table in zip(manager.groups, seq.kv_blocks, strict=True):
            need = -(-computed // group.block_size)
            most = max(need, -(-seq.slot_end // group.block_size))
            if group.kind == "mamba":
                need = most = 1 if computed else 0  # the running state
            if not need <= len(table) <= most:
                raise InvariantError(
                    f"{seq.request_id}: {len(table)} blocks for "
                    f"{computed} computed tokens (need {need}, drafts up to {most})"
                )
            partial = table[computed // bs :]  # blocks not yet full of computed tokens
            if between_steps and group.block_size == bs and _holds_cached(partial):
                raise InvariantError(
                    f"{seq.request_id}: a block past its {computed} computed tokens is cached"
                )
            if group.kind == "sliding_window":
                # The next token (at `computed`) reads keys from computed - W + 1 on.
                first = max(0, computed - group.window + 1) // bs
                if any(not b.block_id for b in table[first:]):
                    raise InvariantError(f"{seq.request_id}: a block inside the window is gone")
        # The tiers get what the last plan calls cacheable: never a draft's block.
        offered = manager.step_plan(seq.request_id).num_cacheable_blocks
        if between_steps and offered * bs > computed:
            raise InvariantError(
                f"{seq.request_id}: {offered} blocks offered to the tiers, "
                f"past its {computed} computed tokens"
            )
    # 7. identical full blocks are never held twice.
    if manager.enable_caching:
        duplicates = count_duplicate_blocks(manager, num_computed)
        if duplicates:
            raise InvariantError(f"{duplicates} duplicate blocks held")
