"""Seat fairness (kvserve.engine.seats): a client request that holds every running seat gives
one up to a single request queued after it within a few steps, and every completion's greedy
tokens stay those of a run without it (also as a property, with client requests arriving at
random). The real manager and the model-free runner."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine.model_free_runner import ModelFreeRunner
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.scheduler import Scheduler, SchedulerConfig
from kvserve.kvcache import KVCacheConfig, KVCacheManager
from kvserve.sampling_params import SamplingParams
from tests.engine.test_scheduler import make, run_all, step

SEATS = 8


def big_request(sched, max_tokens: int = 40) -> list[Request]:
    """`n` = SEATS sequences of one client request (as the engine splits `n`)."""
    seqs = [
        Request(
            f"big-{i}",
            [7, 3, 9, 11, 2, 5, 1, 8],
            SamplingParams(max_tokens=max_tokens),
            parent_id="big",
            index=i,
        )
        for i in range(SEATS)
    ]
    for seq in seqs:
        sched.add_request(seq)
    return seqs


def chat_request(max_tokens: int = 4) -> Request:
    return Request("chat", [40, 41, 42, 43, 44], SamplingParams(max_tokens=max_tokens))


def run(num_blocks: int, with_chat: bool) -> tuple[list[list[int]], Request | None, int]:
    """(each big sequence's tokens, the chat, the step the chat finished at)."""
    sched, runner = make(num_blocks=num_blocks, budget=64, max_seqs=SEATS)
    seqs = big_request(sched)
    for _ in range(3):
        step(sched, runner)
    assert all(s.status is RequestStatus.RUNNING for s in seqs)  # it holds every seat
    chat = chat_request() if with_chat else None
    done_at = -1
    if chat is not None:
        sched.add_request(chat)
    for n, (_, finished) in enumerate(run_all(sched, runner)):
        if chat in finished:
            done_at = n
    return [s.output_token_ids for s in seqs], chat, done_at


def lone_chat_tokens(max_tokens: int = 4) -> list[int]:
    sched, runner = make(budget=64, max_seqs=SEATS)
    chat = chat_request(max_tokens)
    sched.add_request(chat)
    run_all(sched, runner)
    return chat.output_token_ids


def test_a_request_holding_every_seat_gives_one_to_a_later_single_request():
    alone, _, _ = run(num_blocks=256, with_chat=False)
    tokens, chat, done_at = run(num_blocks=256, with_chat=True)
    assert chat is not None and chat.status is RequestStatus.FINISHED_LENGTH
    # Admitted at once (the seat is taken the step after it arrives): 4 tokens in 4 steps,
    # where waiting for a free seat would take the big request's remaining ~37 steps.
    assert done_at <= 5, done_at
    assert chat.output_token_ids == lone_chat_tokens()
    assert tokens == alone  # the preempted sequence recomputed its way to the same tokens


def test_a_client_request_with_one_seat_keeps_it():
    sched, runner = make(budget=64, max_seqs=2)
    first = [Request(f"s{i}", [i + 1] * 5, SamplingParams(max_tokens=6)) for i in range(2)]
    for r in first:
        sched.add_request(r)
    step(sched, runner)
    late = Request("late", [9] * 5, SamplingParams(max_tokens=2))
    sched.add_request(late)
    run_all(sched, runner)
    assert sched.stats.preemptions == 0 and late.status is RequestStatus.FINISHED_LENGTH


def tokens_alone(prompt: list[int], max_tokens: int) -> list[int]:
    sched, runner = make(budget=64, max_seqs=SEATS)
    lone = Request("alone", list(prompt), SamplingParams(max_tokens=max_tokens))
    sched.add_request(lone)
    run_all(sched, runner)
    return lone.output_token_ids


ARRIVAL = st.tuples(
    st.integers(0, 8),  # the step it arrives at
    st.integers(1, 5),  # its sequences (one client request)
    st.integers(1, 12),  # max_tokens
    st.integers(0, 3),  # which prompt
)


@settings(max_examples=60, deadline=None)
@given(st.lists(ARRIVAL, min_size=1, max_size=8), st.sampled_from([256, 12]))
def test_seats_taken_at_random_keep_every_requests_tokens(arrivals, num_blocks):
    """Client requests of several sequences arriving at random steps on 4 seats, in a
    roomy pool or one a few sequences fill (12 blocks of 4 tokens): seats and blocks
    are taken and given back, every request finishes (within `run_all`'s step limit),
    every sequence's greedy tokens are its own alone, and the manager's invariants hold
    after every step (`step`)."""
    sched, runner = make(num_blocks=num_blocks, budget=64, max_seqs=4)
    added: list[tuple[Request, list[int]]] = []
    for now in range(10_000):
        for i, (at, count, max_tokens, which) in enumerate(arrivals):
            if at == now:
                prompt = [10 + which, 20 + which, 30, 40 + which, 50]
                for j in range(count):
                    seq = Request(f"c{i}-{j}", list(prompt), SamplingParams(max_tokens=max_tokens),
                                  client_id=f"c{i}")  # fmt: skip
                    sched.add_request(seq)
                    added.append((seq, prompt))
        if now > max(a[0] for a in arrivals) and not sched.has_unfinished_requests():
            break
        if sched.has_unfinished_requests():
            step(sched, runner)
    for seq, prompt in added:
        assert seq.status is RequestStatus.FINISHED_LENGTH
        assert seq.output_token_ids == tokens_alone(prompt, seq.max_tokens)


def test_a_less_urgent_request_takes_no_seat_under_the_priority_policy():
    manager = KVCacheManager(KVCacheConfig(num_blocks=256, block_size=4))
    config = SchedulerConfig(
        max_num_seqs=2, max_num_batched_tokens=64, scheduling_policy="priority"
    )
    sched, runner = Scheduler(manager, config), ModelFreeRunner()
    for i in range(2):
        seq = Request(f"b{i}", [5, 6, 7, 8], SamplingParams(max_tokens=20), client_id="b")
        sched.add_request(seq)
    step(sched, runner)
    late = Request("late", [9] * 5, SamplingParams(max_tokens=2), priority=1)
    urgent = Request("urgent", [3] * 5, SamplingParams(max_tokens=2), priority=-1)
    sched.add_request(late)
    step(sched, runner)
    assert sched.stats.preemptions == 0 and late.status is RequestStatus.WAITING
    sched.add_request(urgent)  # more urgent than the batch: it takes a seat
    step(sched, runner)
    assert sched.stats.preemptions == 1 and urgent.status is RequestStatus.RUNNING
    run_all(sched, runner)


def pool_filling_batch(sched) -> list[Request]:
    """8 sequences of one client request, distinct 24-token prompts (nothing shared):
    each grows to 16 blocks, 128 together, twice a 64-block pool."""
    seqs = [
        Request(f"batch-{i}", prompt, SamplingParams(max_tokens=40), client_id="batch")
        for i, prompt in enumerate([1000 + 100 * i + j for j in range(24)] for i in range(8))
    ]
    for seq in seqs:
        sched.add_request(seq)
    return seqs


def run_on_a_full_pool(with_chat: bool) -> tuple[list[list[int]], Request | None, int, int]:
    """(each batch sequence's tokens, the chat, the step it finished at, the steps it
    waited while the pool was full): 16 seats, so blocks, not seats, hold it back."""
    sched, runner = make(num_blocks=64, budget=64, max_seqs=16)
    seqs = pool_filling_batch(sched)
    for _ in range(12):
        step(sched, runner)
    assert sched.manager.num_free_blocks < 2  # the batch fills the pool
    chat = chat_request(CHAT_TOKENS) if with_chat else None
    if chat is not None:
        sched.add_request(chat)
    done_at = -1
    for n, (_, finished) in enumerate(run_all(sched, runner)):
        if chat in finished:
            done_at = n
    return [s.output_token_ids for s in seqs], chat, done_at, sched.stats.preemptions


CHAT_TOKENS = 16
"""Enough to grow by blocks while the batch grows too (and preempts from the end)."""


def test_a_batch_filling_the_pool_gives_blocks_to_a_later_single_request():
    alone, _, _, _ = run_on_a_full_pool(with_chat=False)
    tokens, chat, done_at, _ = run_on_a_full_pool(with_chat=True)
    assert chat is not None and chat.status is RequestStatus.FINISHED_LENGTH
    # Its blocks are taken from the batch the step after it arrives, and it is never the
    # one preempted as the batch grows: 16 tokens in about 16 steps, where waiting for a
    # batch sequence to finish takes ~30 more.
    assert done_at <= CHAT_TOKENS + 2, done_at
    assert chat.num_preemptions == 0
    assert chat.output_token_ids == lone_chat_tokens(CHAT_TOKENS)
    assert tokens == alone  # the batch's preempted sequences recompute the same tokens


def test_no_claim_when_the_holders_cannot_make_room():
    """Two client requests of one sequence each fill the pool: neither gives its last
    seat, so a third waits for blocks (no preemption: a claim would only churn)."""
    sched, runner = make(num_blocks=24, budget=64, max_seqs=8)
    for i in range(2):
        prompt = [500 + 50 * i + j for j in range(40)]
        sched.add_request(Request(f"solo-{i}", prompt, SamplingParams(max_tokens=8)))
    step(sched, runner)
    sched.add_request(chat_request())
    step(sched, runner)
    assert sched.stats.preemptions == 0
    run_all(sched, runner)
