"""The waiting queue's order (kvserve.engine.waiting_queue): put back first, then by priority,
round-robin between client requests; and the scheduler admitting by it, with the real manager
and the model-free runner."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine.model_free_runner import ModelFreeRunner
from kvserve.engine.request import Request
from kvserve.engine.scheduler import Scheduler, SchedulerConfig
from kvserve.engine.waiting_queue import WaitingQueue
from kvserve.kvcache import KVCacheConfig, KVCacheManager
from kvserve.sampling_params import SamplingParams
from tests.engine.test_scheduler import run_all, step


def req(rid: str, client: str = "", priority: int = 0, tokens: int = 4) -> Request:
    ids = [100 + (hash(rid) % 1000) + i for i in range(tokens)]
    return Request(rid, ids, SamplingParams(max_tokens=2), client_id=client, priority=priority)


def drain(queue: WaitingQueue) -> list[str]:
    return [queue.popleft().request_id for _ in range(len(queue))]


def test_round_robin_between_client_requests_keeps_each_ones_order():
    queue = WaitingQueue()
    for i in range(4):
        queue.append(req(f"batch-{i}", "batch"))
    queue.append(req("chat"))  # its own client request (client_id defaults to itself)
    queue.append(req("other-0", "other"))
    queue.append(req("other-1", "other"))
    want = ["batch-0", "chat", "other-0", "batch-1", "other-1", "batch-2", "batch-3"]
    assert [r.request_id for r in queue] == want  # iteration shows the pop order
    assert queue[0].request_id == "batch-0"
    assert drain(queue) == want
    assert not queue and len(queue) == 0


def test_a_chat_arriving_behind_a_started_batch_waits_for_one_of_its_requests():
    queue = WaitingQueue()
    for i in range(256):
        queue.append(req(f"e{i}", "embeddings"))
    assert queue.popleft().request_id == "e0"
    queue.append(req("chat"))
    assert [queue.popleft().request_id for _ in range(3)] == ["e1", "chat", "e2"]


def test_lower_priority_first_then_round_robin_within_it():
    queue = WaitingQueue()
    queue.append(req("late-0", "late", priority=5))
    queue.append(req("a-0", "a", priority=0))
    queue.append(req("a-1", "a", priority=0))
    queue.append(req("urgent", priority=-3))
    queue.append(req("b-0", "b", priority=0))
    assert drain(queue) == ["urgent", "a-0", "b-0", "a-1", "late-0"]


def test_put_back_requests_stay_first_whatever_their_priority():
    queue = WaitingQueue()
    queue.append(req("urgent", priority=-10))
    preempted = [req("p1", priority=9), req("p2", priority=9)]
    queue.appendleft(preempted[0])
    queue.appendleft(preempted[1])  # the last preempted is first, as deque.appendleft
    deferred = [req("d1", "x"), req("d2", "x")]
    queue.extendleft(reversed(deferred))  # how schedule() puts deferred requests back
    assert drain(queue) == ["d1", "d2", "p2", "p1", "urgent"]


def test_remove_and_contains():
    queue = WaitingQueue()
    a, b, c, d = req("a", "x"), req("b", "x"), req("c"), req("d")
    for r in (a, b, c):
        queue.append(r)
    queue.appendleft(d)
    queue.remove(b)
    queue.remove(d)
    assert b not in queue and d not in queue and a in queue
    with pytest.raises(ValueError, match="not waiting"):
        queue.remove(b)
    assert drain(queue) == ["a", "c"]
    with pytest.raises(IndexError):
        queue.popleft()
    with pytest.raises(IndexError):
        queue[0]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["add", "front", "pop", "remove"]), st.integers(0, 3)),
        max_size=60,
    )
)
def test_any_sequence_pops_what_iteration_shows_and_loses_nothing(ops):
    queue = WaitingQueue()
    held: list[Request] = []
    for n, (op, k) in enumerate(ops):
        if op in ("add", "front"):
            r = req(f"r{n}", f"c{k}", priority=k % 2)
            queue.append(r) if op == "add" else queue.appendleft(r)
            held.append(r)
        elif op == "remove" and held:
            victim = held.pop(k % len(held))
            queue.remove(victim)
        elif op == "pop" and held:
            shown = list(queue)
            got = queue.popleft()
            assert got is shown[0]
            held.remove(got)
        assert len(queue) == len(held) and set(map(id, queue)) == set(map(id, held))
    before = list(queue)
    assert [queue.popleft() for _ in range(len(before))] == before


def make(budget: int = 16, policy: str = "fcfs") -> Scheduler:
    manager = KVCacheManager(KVCacheConfig(num_blocks=256, block_size=4))
    config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=budget, scheduling_policy=policy
    )
    return Scheduler(manager, config)


def test_scheduler_admits_a_lone_request_within_a_step_of_a_big_batch():
    """A 40-request batch fills the budget for 10 steps in arrival order; the lone request
    queued after it runs in the very next step, and every output is what it is alone."""
    sched, runner = make(), ModelFreeRunner()
    batch = [req(f"b{i}", "batch", tokens=8) for i in range(40)]
    for r in batch:
        sched.add_request(r)
    step(sched, runner)
    lone = req("lone", tokens=8)
    sched.add_request(lone)
    out, _ = step(sched, runner)
    assert lone in [c.request for c in out.chunks]
    run_all(sched, runner)
    alone, runner2 = make(), ModelFreeRunner()
    again = req("lone", tokens=8)
    alone.add_request(again)
    run_all(alone, runner2)
    assert lone.output_token_ids == again.output_token_ids


def test_priority_needs_the_priority_policy():
    with pytest.raises(ValueError, match="scheduling-policy priority"):
        make().add_request(req("p", priority=1))
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        SchedulerConfig(scheduling_policy="lifo")
    sched = make(budget=8, policy="priority")
    runner = ModelFreeRunner()
    for r in (req("normal", tokens=8), req("urgent", priority=-1, tokens=8)):
        sched.add_request(r)
    out, _ = step(sched, runner)
    assert [c.request.request_id for c in out.chunks] == ["urgent"]


def test_requeue_keeps_the_client_place_and_promote_moves_to_the_front():
    queue = WaitingQueue()
    queue.append(req("batch-1", "batch"))
    queue.append(req("chat"))
    taken = req("batch-0", "batch")
    queue.requeue(taken)  # first of its own client's, in its client's place: not the front
    assert [r.request_id for r in queue] == ["batch-0", "chat", "batch-1"]
    alone = req("late", "late")
    queue.requeue(alone)  # a client with nothing waiting joins the back of the rotation
    assert [r.request_id for r in queue] == ["batch-0", "chat", "late", "batch-1"]
    seated = {"batch"}
    first = queue.first_without_seat(seated)
    assert first is not None and first.request_id == "chat"
    queue.promote(first)
    assert drain(queue) == ["chat", "batch-0", "late", "batch-1"]
    assert queue.first_without_seat(seated) is None
