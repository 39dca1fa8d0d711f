"""The step plan: what the manager hands the runner is plain data, fixed once handed out."""

from __future__ import annotations

import dataclasses

import pytest

from kvserve.kvcache import CopyOp, KVCacheConfig, KVCacheManager, StatePlan, StepPlan
from kvserve.kvcache.specs import inflate_for_state, spec_from_name

PLAIN = (int, str, bytes, bool, type(None))


def assert_plain(value, path="plan"):
    """Only numbers, strings, lists and the plan's own dataclasses: no manager objects."""
    if isinstance(value, PLAIN):
        return
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            assert_plain(item, f"{path}[{i}]")
        return
    assert isinstance(value, StepPlan | StatePlan | CopyOp), f"{path}: {type(value).__name__}"
    for field in dataclasses.fields(value):
        assert_plain(getattr(value, field.name), f"{path}.{field.name}")


def manager(groups, num_blocks=64, bs=4):
    specs = inflate_for_state([spec_from_name(g, bs) for g in groups])
    return KVCacheManager(KVCacheConfig(num_blocks=num_blocks, block_size=bs, specs=specs))


@pytest.mark.parametrize("groups", [("full",), ("full", "sliding:6"), ("full", "mamba:2")])
def test_plans_are_plain_data_with_every_group(groups):
    m = manager(groups)
    prompt = list(range(1, 16))  # the hit (12 tokens) ends inside an 8-token inflated block
    m.add_request("a", list(prompt))
    assert m.allocate_slots("a", len(prompt), 0)
    plan = m.step_plan("a")
    m.end_step()
    m.add_request("b", list(prompt))  # a hit: shared blocks, copies, a state to resume from
    hit = m.get_computed_blocks("b")
    assert hit.num_tokens
    assert m.allocate_slots("b", len(prompt) - hit.num_tokens, hit.num_tokens, hit)
    plan_b = m.step_plan("b")
    assert m.step_plan("b") == plan_b  # a query: asking again changes nothing
    for p in (plan, plan_b):
        assert_plain(p)
        assert len(p.block_ids) == len(groups)
    assert (plan_b.start, plan_b.end) == (hit.num_tokens, len(prompt))
    assert [list(t) for t in plan_b.block_ids] == m.block_ids("b")
    if "mamba:2" in groups:
        assert plan_b.state_plans is not None and plan_b.state_plans[1] is not None
        assert plan_b.copies  # the hit ends inside an inflated block: copy-on-write
    else:
        assert plan_b.state_plans is None and not plan_b.copies


def test_a_plan_handed_out_does_not_change_when_the_manager_merges_later():
    """Identical decodes fill identical blocks: the manager merges after the step, but
    the plan the runner got for that step still names the block it wrote."""
    m = manager(("full",))
    for rid in ("a", "b"):
        m.add_request(rid, [1, 2, 3, 4, 5, 6])
        assert m.allocate_slots(rid, 6, 0, m.get_computed_blocks(rid))
    m.end_step()
    tokens = {rid: m.sequence(rid).token_ids for rid in ("a", "b")}
    plans = {}
    for step in range(2):  # positions 6 and 7: the second fills block 1
        for rid in ("a", "b"):
            tokens[rid].append(9)
            assert m.allocate_slots(rid, 1, 6 + step)
            plans[rid] = m.step_plan(rid)
        m.end_step()
    assert m.stats.merges == 1
    assert m.block_ids("a") == m.block_ids("b")  # merged after the step
    assert plans["a"].block_ids != plans["b"].block_ids  # what each wrote during it
    assert plans["b"].block_ids[0][1] != m.block_ids("b")[0][1]


def test_offloadable_blocks_stop_at_a_broken_chain():
    m = manager(("full",))
    m.add_request("a", list(range(10)))
    assert m.allocate_slots("a", 10, 0)
    assert m.step_plan("a").num_cacheable_blocks == 2  # 10 tokens: 2 full hash blocks
    off = KVCacheManager(KVCacheConfig(num_blocks=8, block_size=4, enable_prefix_caching=False))
    off.add_request("a", list(range(10)))
    assert off.allocate_slots("a", 10, 0)
    assert off.step_plan("a").num_cacheable_blocks == 0


@pytest.mark.parametrize("groups", [("full",), ("full", "full"), ("full", "sliding:6")])
def test_a_decode_inside_its_block_plans_what_the_coordinator_would(groups):
    """allocate_slots answers a decode token inside the block it fills without the
    coordinator (no block taken, none registered): every plan and table must be the one
    the coordinator gives. Two identical requests, so blocks also merge after steps."""
    fast, slow = manager(groups), manager(groups)
    slow._in_place_decodes = False  # the coordinator for every allocation
    assert fast._in_place_decodes == ("sliding:6" not in groups)
    for m in (fast, slow):
        for rid in ("a", "b"):
            m.add_request(rid, list(range(1, 8)))
    computed = {"a": 0, "b": 0}
    for step in range(14):
        for rid in ("a", "b"):
            new = 7 if step == 0 else 1
            for m in (fast, slow):
                assert m.allocate_slots(rid, new, computed[rid])
            assert fast.step_plan(rid) == slow.step_plan(rid)
            assert fast.block_ids(rid) == slow.block_ids(rid)
            computed[rid] += new
        for m in (fast, slow):
            m.end_step()
            for rid in ("a", "b"):
                m.sequence(rid).token_ids.append(100 + step)
    assert fast.pool.free_block_ids() == slow.pool.free_block_ids()
