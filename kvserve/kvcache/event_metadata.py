"""What a consumer needs to hash and match the way an engine does.

Events carry hashes, not the recipe. A router that wants to predict a hit
must compute a request's block hashes itself (same function, seed, hash
block size, token packing and extra keys) and apply the engine's per-group
rules; this describes all of it as plain JSON-able data.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvserve.kvcache.events import MEDIUM_GPU

if TYPE_CHECKING:
    from kvserve.kvcache.manager import KVCacheManager

METADATA_VERSION = 1


def kv_events_metadata(
    manager: KVCacheManager, int_block_hashes: bool = True, medium: str = MEDIUM_GPU
) -> dict[str, Any]:
    """Per group: kind, physical block size, hash_block_size, window, hash function, seed."""
    hasher = manager.hasher
    groups = []
    for group in manager.groups:
        groups.append(
            {
                "group_idx": group.group_id,
                "kind": group.kind,
                "block_size": group.block_size,
                "hash_block_size": manager.block_size,
                "sliding_window": getattr(group, "window", None),
                "hash_fn": hasher.hash_name,
                "hash_seed": hasher.seed,
            }
        )
    anchor = next((g.group_id for g in manager.groups if g.kind == "full_attention"), None)
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
        "medium": medium,
        "groups": groups,
    }
