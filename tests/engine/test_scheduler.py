"""The scheduler with the real manager and the model-free runner."""

import pytest

from kvserve.engine.model_free_runner import ModelFreeRunner
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.scheduler import Scheduler, SchedulerConfig, sampled_tokens
from kvserve.kvcache import KVCacheConfig, KVCacheManager, check_invariants
from kvserve.sampling_params import SamplingParams

BS = 4


def execute(runner, out, manager):
    """One runner step over the scheduler's plans: request id -> sampled token."""
    chunks = out.seq_chunks(manager)
    return sampled_tokens(chunks, runner.execute(chunks))


def make(num_blocks=64, budget=32, max_seqs=8, max_model_len=None, caching=True):
    manager = KVCacheManager(
        KVCacheConfig(num_blocks=num_blocks, block_size=BS, enable_prefix_caching=caching)
    )
    config = SchedulerConfig(
        max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len
    )
    return Scheduler(manager, config), ModelFreeRunner()


def step(sched, runner):
    out = sched.schedule()
    finished = sched.update(out, execute(runner, out, sched.manager))
    held = sched.running
    check_invariants(sched.manager, {r.request_id: r.num_computed_tokens for r in held})
    return out, finished


def run_all(sched, runner, limit=10_000):
    steps = []
    while sched.has_unfinished_requests():
        steps.append(step(sched, runner))
        assert len(steps) < limit
    return steps


def test_decodes_first_then_chunked_prefill_within_budget():
    sched, runner = make(budget=10)
    a = Request("a", list(range(100, 106)), params=SamplingParams(max_tokens=5))
    sched.add_request(a)
    step(sched, runner)  # a's prompt (6 tokens)
    b = Request("b", list(range(200, 230)), params=SamplingParams(max_tokens=2))
    sched.add_request(b)
    out, _ = step(sched, runner)
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 8)]
    # The partial chunk ends on a block boundary (1 + 8 <= 10; 9 would not be aligned).
    assert b.num_computed_tokens == 8
    out, _ = step(sched, runner)
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 8)]
    for out, _ in run_all(sched, runner):
        assert out.num_batched_tokens <= 10
    assert a.num_output_tokens == 5 and b.num_output_tokens == 2


def test_max_num_seqs_and_fcfs():
    sched, runner = make(max_seqs=2, budget=100)
    reqs = [Request(f"r{i}", [i + 1] * 5, SamplingParams(max_tokens=3)) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    out, _ = step(sched, runner)
    assert [c.request.request_id for c in out.chunks] == ["r0", "r1"]
    finished_order = [r.request_id for _, done in run_all(sched, runner) for r in done]
    assert finished_order == ["r0", "r1", "r2", "r3"]


def test_never_fitting_request_is_rejected_and_others_go_on():
    sched, runner = make(num_blocks=9, max_model_len=40)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(Request("long", list(range(1, 40)), params=SamplingParams(max_tokens=5)))
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add_request(Request("huge", list(range(1, 30)), params=SamplingParams(max_tokens=8)))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(Request("empty", [], SamplingParams(max_tokens=8)))
    ok = Request("ok", list(range(1, 10)), params=SamplingParams(max_tokens=4))
    sched.add_request(ok)
    run_all(sched, runner)
    assert ok.status is RequestStatus.FINISHED_LENGTH and ok.num_output_tokens == 4


def test_max_request_tokens_is_the_longest_request_admitted():
    assert make(max_model_len=None)[0].max_request_tokens() is None
    for blocks, limit in ((64, 40), (9, 40), (9, 200)):
        sched, _ = make(num_blocks=blocks, max_model_len=limit)
        most = sched.max_request_tokens()
        assert most is not None and 0 < most <= limit
        prompt = list(range(1, 6))
        fits = Request("fits", prompt, params=SamplingParams(max_tokens=most - len(prompt)))
        sched.add_request(fits)  # admitted
        over = Request("over", prompt, params=SamplingParams(max_tokens=most - len(prompt) + 1))
        with pytest.raises(ValueError):
            sched.add_request(over)
    assert make(num_blocks=64, max_model_len=40)[0].max_request_tokens() == 40


def test_preemption_of_newest_and_recompute_gives_same_tokens():
    prompts = [[7, i, 3, 9, 11, 2, 5, i, 1, 8] for i in range(1, 6)]

    def outputs(num_blocks):
        sched, runner = make(num_blocks=num_blocks, budget=64, max_seqs=8)
        reqs = [
            Request(f"r{i}", list(p), params=SamplingParams(max_tokens=12))
            for i, p in enumerate(prompts)
        ]
        for r in reqs:
            sched.add_request(r)
        run_all(sched, runner)
        return [r.output_token_ids for r in reqs], sched.stats.preemptions, reqs

    ample, none, _ = outputs(64)
    tight, preemptions, reqs = outputs(10)
    assert none == 0 and preemptions > 0
    assert tight == ample
    # The newest request is preempted first: the oldest never is.
    assert reqs[0].num_preemptions == 0
    assert max(r.num_preemptions for r in reqs[1:]) > 0


def test_same_step_identical_prompts_compute_once():
    sched, runner = make(budget=200)
    reqs = [
        Request(f"r{i}", list(range(1, 23)), params=SamplingParams(max_tokens=2)) for i in range(3)
    ]
    for r in reqs:
        sched.add_request(r)
    out, _ = step(sched, runner)
    # 22 tokens = 5 full blocks + 2: the first computes all, the others only the tail.
    assert [c.num_tokens for c in out.chunks] == [22, 2, 2]
    assert [r.num_cached_tokens for r in reqs] == [0, 20, 20]
    assert sched.manager.pool.num_used == 5 + 3


def test_later_chunk_takes_blocks_another_request_cached_meanwhile():
    sched, runner = make(budget=12)
    prompt = list(range(1, 33))  # 8 blocks
    a = Request("a", list(prompt), params=SamplingParams(max_tokens=1))
    sched.add_request(a)
    step(sched, runner)  # a computes 12 tokens
    b = Request("b", list(prompt), params=SamplingParams(max_tokens=1))
    sched.add_request(b)
    for _ in run_all(sched, runner):
        pass
    # b joined later and never computed what a had cached when it arrived; a never
    # recomputed what b cached first: 32 prompt tokens computed once, plus b's last one.
    assert sched.stats.prefill_tokens_computed == 32 + 1


def test_fully_cached_prompt_computes_one_token():
    sched, runner = make()
    first = Request("first", list(range(1, 9)), params=SamplingParams(max_tokens=1))
    sched.add_request(first)
    run_all(sched, runner)
    again = Request("again", list(range(1, 9)), params=SamplingParams(max_tokens=3))
    sched.add_request(again)
    out, _ = step(sched, runner)
    assert [(c.start, c.num_tokens) for c in out.chunks] == [(7, 1)]
    record = sched.manager.sequence("again")
    assert record.skip_write_tokens == 8 and again.num_cached_tokens == 7
    run_all(sched, runner)
    assert again.output_token_ids[0] == first.output_token_ids[0]


def test_no_prefix_caching_computes_every_prompt_token():
    sched, runner = make(caching=False, budget=200)
    for i in range(3):
        sched.add_request(Request(f"r{i}", list(range(1, 23)), params=SamplingParams(max_tokens=2)))
    run_all(sched, runner)
    assert sched.stats.prefill_tokens_computed == 66
    assert sched.stats.prefix_hit_tokens == 0


def test_abort_frees_blocks_and_others_continue():
    sched, runner = make()
    a = Request("a", list(range(1, 10)), params=SamplingParams(max_tokens=20))
    b = Request("b", list(range(50, 60)), params=SamplingParams(max_tokens=3))
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)
    sched.abort_request(a)
    assert a.status is RequestStatus.FINISHED_ABORTED
    run_all(sched, runner)
    assert b.num_output_tokens == 3
    assert sched.manager.pool.num_used == 0


class RefusingManager(KVCacheManager):
    """Places nothing for request "stuck" (a stand-in for a manager fault)."""

    def allocate_slots(self, request_id, *args, **kwargs):
        if request_id == "stuck":
            return False
        return super().allocate_slots(request_id, *args, **kwargs)


def test_a_request_that_cannot_be_placed_on_an_idle_pool_fails_alone():
    """Liveness: admission said it fits, yet the manager cannot place it while nothing
    runs, so no block will ever come back for it. It fails with the reason (never a
    step that schedules nothing for ever); requests after it run."""
    manager = RefusingManager(KVCacheConfig(num_blocks=64, block_size=BS))
    sched, runner = Scheduler(manager, SchedulerConfig()), ModelFreeRunner()
    stuck = Request("stuck", list(range(1, 10)), params=SamplingParams(max_tokens=4))
    ok = Request("ok", list(range(1, 10)), params=SamplingParams(max_tokens=4))
    sched.add_request(stuck)
    sched.add_request(ok)
    out, finished = step(sched, runner)
    assert out.rejected == [stuck] and stuck in finished
    assert stuck.status is RequestStatus.FINISHED_ERROR and "idle pool" in stuck.error
    assert [c.request for c in out.chunks] == [ok]
    run_all(sched, runner)
    assert ok.status is RequestStatus.FINISHED_LENGTH
    assert sched.stats.rejected == 1 and manager.pool.num_used == 0


def test_a_request_waiting_for_blocks_others_hold_waits():
    """Not a liveness fault: while requests run, their blocks come back."""
    sched, runner = make(num_blocks=9, budget=64)
    first = Request("a", list(range(1, 20)), params=SamplingParams(max_tokens=8))
    second = Request("b", list(range(30, 49)), params=SamplingParams(max_tokens=8))
    sched.add_request(first)
    sched.add_request(second)
    out, _ = step(sched, runner)
    assert [c.request for c in out.chunks] == [first] and not out.rejected
    run_all(sched, runner)
    assert second.status is RequestStatus.FINISHED_LENGTH and not sched.stats.rejected
