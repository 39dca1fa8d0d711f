"""Lookahead slots for draft tokens: allocated, written, reused, never cached until accepted.

Speculative decoding allocates slots past a decode's token for its drafts
(`num_lookahead_tokens`). Only `accept_tokens` makes drafts part of the
request: the blocks they fill are registered (and announced) then, and a
rejected draft's slot is simply written again by the next step.
"""

from __future__ import annotations

import pytest

from kvserve.kvcache import KVCacheConfig, KVCacheManager, check_invariants
from kvserve.kvcache.event_sink import KVEventSink
from kvserve.kvcache.events import BlockStored
from kvserve.kvcache.invariants import InvariantError
from kvserve.kvcache.specs import inflate_for_state, spec_from_name

BS = 4


def decoding(tokens: list[int], num_blocks: int = 16, groups=("full",)):
    """A manager holding one request whose prompt `tokens` is computed, with events."""
    specs = [spec_from_name(g, BS) for g in groups]
    m = KVCacheManager(KVCacheConfig(num_blocks, BS, specs=specs))
    sink = KVEventSink(BS, int_block_hashes=False)
    m.attach_events(sink)
    m.add_request("r", tokens)
    assert m.allocate_slots("r", len(tokens) - 1, 0)
    m.end_step()
    return m, sink


def test_drafts_get_slots_but_no_hash_until_accepted():
    tokens = [5, 6, 7, 8, 9, 10]  # 6 tokens: 5 computed, the 6th is the decode's
    m, sink = decoding(tokens)
    sink.take()
    assert m.allocate_slots("r", 1, 5, num_lookahead_tokens=3)  # drafts at 6, 7, 8
    plan = m.step_plan("r")
    assert (plan.start, plan.num_tokens, plan.num_lookahead_tokens) == (5, 4, 3)
    assert len(plan.block_ids[0]) == 3  # slots up to position 8
    assert plan.num_cacheable_blocks == 1  # only the prompt's full block
    # Two drafts accepted (positions 6 and 7): the second block fills, with accepted tokens.
    tokens += [11, 12]
    m.accept_tokens("r", 8)
    m.end_step()
    stored = [e for e in sink.take() if isinstance(e, BlockStored)]
    assert [e.token_ids for e in stored] == [[9, 10, 11, 12]]
    check_invariants(m, {"r": 8})
    # The third block holds only a rejected draft's slot: held, reused, never cached.
    table = m.block_ids("r")[0]
    tokens.append(13)
    assert m.allocate_slots("r", 1, 8, num_lookahead_tokens=2)
    assert m.block_ids("r")[0] == table  # positions 8..10 fit the blocks held
    m.end_step()  # every draft rejected
    check_invariants(m, {"r": 9})
    assert not [e for e in sink.take() if isinstance(e, BlockStored)]


def test_the_checker_catches_a_cached_block_past_the_computed_tokens():
    m, _ = decoding([1, 2, 3, 4, 5, 6, 7, 8, 9])
    check_invariants(m, {"r": 8})
    with pytest.raises(InvariantError, match="past its 4 computed tokens is cached"):
        check_invariants(m, {"r": 4})  # as if the second block's tokens were drafts


def test_accepting_more_than_the_slots_is_refused():
    m, _ = decoding([1, 2, 3, 4, 5])
    assert m.allocate_slots("r", 1, 4, num_lookahead_tokens=1)
    with pytest.raises(ValueError, match="accepted tokens but slots for 6"):
        m.accept_tokens("r", 7)


def test_state_groups_refuse_lookahead_slots():
    specs = inflate_for_state([spec_from_name(g, BS) for g in ("full", "mamba:2")])
    m = KVCacheManager(KVCacheConfig(32, BS, specs=specs))
    m.add_request("r", [1, 2, 3])
    with pytest.raises(ValueError, match="Mamba state group's running state"):
        m.allocate_slots("r", 3, 0, num_lookahead_tokens=2)
