"""The KV cache: pure Python, never imports torch.

Hashing, the block pool, per-group managers, the coordinators and the
manager facade the scheduler uses; the step plan is what it hands the
runner. See docs/design.md for the invariants this package keeps.
"""

from kvserve.kvcache.block import KVBlock
from kvserve.kvcache.block_pool import BlockPool, NoFreeBlocksError
from kvserve.kvcache.config import KVCacheConfig
from kvserve.kvcache.coordinator import KVCacheStats, PrefixHit
from kvserve.kvcache.hashing import HASH_FUNCTIONS, BlockHasher, extra_key_bytes
from kvserve.kvcache.invariants import InvariantError, check_invariants, count_duplicate_blocks
from kvserve.kvcache.manager import KVCacheManager
from kvserve.kvcache.plan import CopyOp, StatePlan, StepPlan
from kvserve.kvcache.sequence import CacheSequence
from kvserve.kvcache.specs import FullAttentionSpec, KVCacheSpec

__all__ = [
    "HASH_FUNCTIONS",
    "BlockHasher",
    "BlockPool",
    "CacheSequence",
    "CopyOp",
    "FullAttentionSpec",
    "InvariantError",
    "KVBlock",
    "KVCacheConfig",
    "KVCacheManager",
    "KVCacheSpec",
    "KVCacheStats",
    "NoFreeBlocksError",
    "PrefixHit",
    "StatePlan",
    "StepPlan",
    "check_invariants",
    "count_duplicate_blocks",
    "extra_key_bytes",
]
