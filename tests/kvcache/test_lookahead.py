"""Lookahead slots for draft tokens: allocated, written, reused, never cached until accepted.

Speculative decoding allocates slots past a decode's token for its drafts
(`num_lookahead_tokens`). Only `accept_tokens` makes drafts part of the
request: the blocks they fill are registered (and announced) then, and a
rejected draft's slot is simply written again by the next step.
"""

from __future__ import annotations

import pytest
from _cache_seqs import add_seq
from _kvsim import Sim, next_token

from kvserve.kvcache import CacheSequence, KVCacheConfig, KVCacheManager, check_invariants
from kvserve.kvcache.coordinator import AttentionCoordinator
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


@pytest.mark.parametrize("bs", [1, 2, 4])
def test_identical_sequences_merge_the_blocks_their_accepted_drafts_fill(bs):
    """Issue 33: two identical sequences in one verification step. The decode token fills
    a block (b queues a late merge onto a's copy), then accepted drafts fill the next one
    (registered by accept_tokens before that merge): b's block must chain to a's copy, as
    the next step's allocation would, and merge. Once it chained to b's own unregistered
    block: a false collision, a duplicate held and a later hit short by the rest."""
    m = KVCacheManager(KVCacheConfig(32, bs))
    sink = KVEventSink(bs, int_block_hashes=False)
    m.attach_events(sink)
    prompt = list(range(1, 3 * bs))  # 3*bs - 1 tokens
    tokens = {rid: list(prompt) for rid in "ab"}
    for rid in "ab":  # same step: b shares a's pending blocks
        m.add_request(rid, tokens[rid])
        hit = m.get_computed_blocks(rid)
        assert m.allocate_slots(rid, len(prompt) - hit.num_tokens, hit.num_tokens, hit)
    m.end_step()
    accepted, rejected = list(range(50, 50 + bs)), 99
    for rid in "ab":
        tokens[rid].append(7)  # the sampled token; its decode fills block 2
        assert m.allocate_slots(rid, 1, len(prompt), num_lookahead_tokens=bs + 1)
    for rid in "ab":  # verified: bs drafts accepted (block 3 fills), the last rejected
        tokens[rid] += accepted
        m.accept_tokens(rid, 4 * bs)
    m.end_step()
    check_invariants(m, {"a": 4 * bs, "b": 4 * bs})  # no duplicate block held
    assert m.block_ids("a")[0][:4] == m.block_ids("b")[0][:4]  # then each its draft slot
    assert m.stats.merges >= 2  # b's blocks 2 and 3 merged onto a's
    stored = [e for e in sink.take() if isinstance(e, BlockStored)]
    assert all(rejected not in e.token_ids for e in stored)
    hashes = m.block_hashes("a")
    seen = [h for e in stored for h in e.block_hashes]
    assert seen == list(hashes[:4]), "one event per block, for accepted tokens only"
    # The next lookups hit in full: a third copy, and a preempted one recomputing.
    m.add_request("c", tokens["a"] + [8])
    hit = m.get_computed_blocks("c")
    assert hit.num_tokens == 4 * bs and hit.blocks[0] == m.sequence("a").kv_blocks[0][:4]
    m.free("a")
    hit = m.get_computed_blocks("a")
    assert hit.num_tokens == 4 * bs - 1 and hit.skip_write_tokens == 4 * bs


def test_the_state_machines_schedule_for_issue_33():
    """The schedule test_stateful.py found (seed 7), replayed through its oracle (Sim):
    no duplicate held, and a preempted copy hits every block the other holds."""
    m = KVCacheManager(KVCacheConfig(9, 1, hash_seed=0))
    sim = Sim(m)
    seqs = [add_seq(m, CacheSequence(f"r{i}", [0, 1, 2, 0])) for i in range(2)]
    for seq in seqs:
        assert sim.schedule(seq)
    sim.end_step()
    for seq in seqs:  # a decode with one draft, which the "model" (next_token) accepts
        assert sim.schedule(seq, None, [next_token(seq.token_ids)])
    sim.end_step()  # check_invariants: no duplicate block
    assert sim.computed == {"r0": 6, "r1": 6}
    sim.free(seqs[0])
    assert sim.schedule(seqs[0])  # check_hit: as long as what r1 holds
    assert sim.hits[-1] == ("r0", 6)


def test_the_checker_catches_a_hash_over_a_rejected_draft():
    tokens = [1, 2, 3, 4, 5, 6]
    m, _ = decoding(tokens)
    assert m.allocate_slots("r", 1, 5, num_lookahead_tokens=2)  # drafts at 6 and 7
    tokens += [70, 80]  # the bug: drafts in the token list while block 1 is hashed
    m.coordinator.hash(m.sequence("r"))
    del tokens[-2:]
    m.end_step()  # both rejected
    tokens += [7, 8]  # later the real tokens fill block 1
    with pytest.raises(InvariantError, match="a block hash is not its tokens' hash"):
        check_invariants(m, {"r": 6})


class DraftsOfferedCoordinator(AttentionCoordinator):
    """A plan that offers the draft slots' blocks to the tiers (the bug, on purpose)."""

    def plan(self, seq):
        end = seq.step_start + seq.step_tokens + seq.step_lookahead
        return super().plan(seq)._replace(num_cacheable_blocks=end // self.block_size)


class DraftsOfferedManager(KVCacheManager):
    @classmethod
    def _coordinator_type(cls, has_state: bool) -> type:
        return DraftsOfferedCoordinator


def test_the_checker_catches_a_draft_block_offered_to_the_tiers():
    m = DraftsOfferedManager(KVCacheConfig(16, BS))
    tokens = [1, 2, 3, 4, 5, 6]
    m.add_request("r", tokens)
    assert m.allocate_slots("r", 5, 0)
    m.end_step()
    assert m.allocate_slots("r", 1, 5, num_lookahead_tokens=2)  # drafts fill block 1
    m.end_step()  # both rejected
    with pytest.raises(InvariantError, match="2 blocks offered to the tiers, past its 6"):
        check_invariants(m, {"r": 6})
