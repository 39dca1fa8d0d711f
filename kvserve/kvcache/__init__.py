"""The KV cache: pure Python, never imports torch.

Hashing, the block pool, per-group managers and the manager facade the
scheduler uses. See DESIGN.md for the invariants this package keeps.
"""

from kvserve.kvcache.block import KVBlock
from kvserve.kvcache.block_pool import BlockPool, NoFreeBlocksError
from kvserve.kvcache.hashing import HASH_FUNCTIONS, BlockHasher, extra_key_bytes
from kvserve.kvcache.invariants import InvariantError, check_invariants, count_duplicate_blocks
from kvserve.kvcache.manager import KVCacheConfig, KVCacheManager, KVCacheStats, PrefixHit
from kvserve.kvcache.sequence import CacheSequence
from kvserve.kvcache.specs import FullAttentionSpec, KVCacheSpec

__all__ = [
    "HASH_FUNCTIONS",
    "BlockHasher",
    "BlockPool",
    "CacheSequence",
    "FullAttentionSpec",
    "InvariantError",
    "KVBlock",
    "KVCacheConfig",
    "KVCacheManager",
    "KVCacheSpec",
    "KVCacheStats",
    "NoFreeBlocksError",
    "PrefixHit",
    "check_invariants",
    "count_duplicate_blocks",
    "extra_key_bytes",
]
