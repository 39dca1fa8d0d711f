"""Tests describe a request as a CacheSequence; the manager keeps its own record of it."""

from __future__ import annotations

from kvserve.kvcache import CacheSequence, KVCacheManager


def add_seq(m: KVCacheManager, seq: CacheSequence) -> CacheSequence:
    """Add `seq`'s request to `m` and make `seq` the manager's record of it.

    The manager builds its own record; the test's object takes that record's
    place (same fields, same token list), so a test that keeps its reference
    reads exactly what the manager holds, as the tests did before the
    manager owned its records.
    """
    m.add_request(seq.request_id, seq.token_ids, seq.lora_name, seq.cache_salt)
    record = m.sequence(seq.request_id)
    for name in CacheSequence.__slots__:
        setattr(seq, name, getattr(record, name))
    m._seqs[seq.request_id] = seq
    return seq
