"""Seat fairness (kvserve.engine.seats): a client request that holds every running seat gives
one up to a single request queued after it within a few steps, and
every completion's greedy tokens stay those of a run without it. The real manager and the
model-free runner."""

from __future__ import annotations

from kvserve.engine.request import Request, RequestStatus
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


def chat_request() -> Request:
    return Request("chat", [40, 41, 42, 43, 44], SamplingParams(max_tokens=4))


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


def lone_chat_tokens() -> list[int]:
    sched, runner = make(budget=64, max_seqs=SEATS)
    chat = chat_request()
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
