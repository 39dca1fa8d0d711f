"""The KV cache: pure Python, never imports torch.

Hashing, the block pool, per-group managers, the coordinators and the
manager facade the scheduler uses; the step plan is what it hands the
runner. See docs/design.md for the invariants this package keeps.

Files:

    specs.py        what a group stores per block (full, sliding window, Mamba state);
                    inflate_for_state (one page size for attention and state groups)
    plan.py         StepPlan, StatePlan, CopyOp: the KV cache's answer for one step
    config.py       KVCacheConfig
    manager.py      KVCacheManager: the facade; one record per request, keyed by id
    coordinator.py  PrefixHit, KVCacheStats, the shared Coordinator base and the
                    AttentionCoordinator (full attention + sliding windows)
    state_coordinator.py  StateCoordinator (inflated attention + Mamba state groups)
    groups.py, inflated_group.py, state_group.py   per-group managers
    sequence.py     CacheSequence: the manager's record of one request
    block.py, block_pool.py   blocks, index entries, the pool (free queue, index)
    hashing.py      chained block hashes
    events.py, event_sink.py, event_snapshot.py, event_metadata.py   KV events (types)
    invariants.py   check_invariants: design.md's invariants, on the manager's records
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
