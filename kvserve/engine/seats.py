"""Seat fairness: a client request that holds no running seat takes one from the biggest.

Round-robin admission (waiting_queue.py) only helps once a seat frees up. A client
request that already holds every seat (`max_num_seqs`: `n` = 64 completions with long
`max_tokens`, a 256-prompt batch) would make a chat queued after it wait for its whole
duration. So, before a step is scheduled, when every seat is taken and a waiting
request belongs to a client request holding no seat (and the free blocks would hold
its first chunk), the client request holding the most seats (more than one; among
those no more urgent than it under `--scheduling-policy priority`) gives one up: its
most recently admitted sequence is preempted (its blocks stay cached, so its
recompute mostly hits) and goes back, first among its own client request's waiting
ones, into that client's place in the rotation (`WaitingQueue.requeue`), not the front
lane, which would give the seat right back; the seatless request moves to the front
lane. Where blocks, not seats, hold the seatless request back (a batch filling the KV
pool), a seat would not place it, only churn: it waits for blocks to come back. One seat
a step: a few single requests behind a batch are each admitted within a
few steps. A client request never loses its last seat, so the swap cannot repeat: the
new holder has a seat.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from kvserve.engine.request import Request
from kvserve.engine.waiting_queue import WaitingQueue


def seat_to_take(
    running: Sequence[Request],
    waiting: WaitingQueue,
    max_num_seqs: int,
    has_blocks: Callable[[Request], bool],
) -> tuple[Request, Request] | None:
    """(the running sequence to preempt, the waiting request the seat goes to), or None.

    `has_blocks(request)`: whether the free blocks hold its first chunk. Where they do
    not, blocks hold it back, not seats: a seat taken would not place it, only churn."""
    if not waiting or len(running) < max_num_seqs:
        return None  # a seat is free: the waiting are admitted in their turn
    seats = Counter(r.client_id for r in running)
    if seats.most_common(1)[0][1] < 2:
        return None  # every client request holds one seat: none has one to give
    seatless = waiting.first_without_seat(seats)
    if seatless is None or not has_blocks(seatless):
        return None
    # Only from a client request no more urgent than it (--scheduling-policy priority).
    givers = Counter(r.client_id for r in running if r.priority >= seatless.priority)
    if not givers:
        return None
    holder, held = givers.most_common(1)[0]
    if held < 2:
        return None
    victim = next(r for r in reversed(running) if r.client_id == holder)
    return victim, seatless
