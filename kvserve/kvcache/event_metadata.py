"""What a consumer needs to hash and match the way an engine does.

Events carry hashes, not the recipe. A router that wants to predict a hit
must compute a request's block hashes itself (same function, seed, hash
block size, token packing and extra keys) and apply the engine's per-group
rules; this describes all of it as plain JSON-able data.

In hybrid models with state (Mamba) groups the physical block (`block_size`)
is larger than the hash block, but events and matching stay per hash block;
the physical size matters to a consumer only as the snapshot interval of
the state groups, which is why both are reported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvserve.kvcache.events import MEDIUM_GPU

if TYPE_CHECKING:
    from kvserve.kvcache.manager import KVCacheManager

METADATA_VERSION = 1

HIT_RULES = {
    "prefix": (
        "anchor group: longest verified run of hash blocks from the left; other full-attention "
        "groups: their own runs; sliding windows: the window before the hit end must be cached; "
        "a hit of every token stops one short (len - 1)"
    ),
    "state": (
        "at most (len - 1) // hash_block_size hash blocks; attention groups: any prefix of their "
        "verified runs; every state group needs a snapshot stored under the hash of the hit's "
        "last hash block; the hit is the largest such end"
    ),
}
"""How an engine turns cached blocks into a hit (kvserve.events.index implements both)."""


def kv_events_metadata(
    manager: KVCacheManager, int_block_hashes: bool = True, medium: str = MEDIUM_GPU
) -> dict[str, Any]:
    """Per group: kind, physical block size, hash_block_size, window, hash function, seed."""
    hasher = manager.hasher
    anchor = next((g.group_id for g in manager.groups if g.kind == "full_attention"), None)
    # Without an anchor, window blocks are verified by their tokens only.
    other = "anchor" if anchor is not None else "tokens"
    groups = []
    for group in manager.groups:
        info = {
            "group_idx": group.group_id,
            "kind": group.kind,
            "block_size": group.block_size,
            "hash_block_size": manager.block_size,
            "sliding_window": getattr(group, "window", None),
            "hash_fn": hasher.hash_name,
            "hash_seed": hasher.seed,
            "verified_against": "parent" if group.kind == "full_attention" else other,
        }
        if group.kind == "mamba":
            # Snapshots: every physical block, and the last hash-block boundary of a prompt.
            info["snapshot_interval"] = group.block_size
        groups.append(info)
    has_state = any(g.kind == "mamba" for g in manager.groups)
    return {
        "version": METADATA_VERSION,
        "hash_block_size": manager.block_size,
        "hash_fn": hasher.hash_name,
        "hash_seed": hasher.seed,
        "hash_recipe": (
            "root = H(b'kvserve-root:' + str(seed)); block = H(parent + token ids as uint32 "
            "little-endian + extra keys); extra keys: cache salt (first block) then LoRA name, "
            "each b'S'/b'L' + uint32-le length + utf-8"
        ),
        "block_hash_encoding": "u64: last 8 bytes big-endian" if int_block_hashes else "bytes",
        "enable_prefix_caching": manager.enable_caching,
        "verify_hits": manager.config.verify_hits,
        "anchor_group": anchor,
        "hit_rule": "state" if has_state else "prefix",
        "hit_rule_text": HIT_RULES["state" if has_state else "prefix"],
        "medium": medium,
        "groups": groups,
    }
