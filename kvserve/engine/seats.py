"""Fair shares: a client request that holds no running seat gets a seat and blocks from the biggest.

Round-robin admission (waiting_queue.py) only helps once a seat and blocks free up.
A client request that holds every seat (`max_num_seqs`: `n` = 64 completions with long
`max_tokens`, a 256-prompt batch) or fills the KV pool would make a chat queued after
it wait until one of its sequences finishes. So, before a step is scheduled, when a
waiting request belongs to a client request holding no seat and either every seat is
taken or the free blocks do not hold its first chunk, the client requests holding the
most seats (more than one each; among those no more urgent than it under
`--scheduling-policy priority`) give sequences up, the biggest holder first, each its
most recently admitted: until a seat is free and the blocks they release (those no
other request shares) cover the shortfall. A victim is preempted (its blocks stay
cached, so its recompute mostly hits) and goes back into its own client's place in the
rotation, not the front lane, which would readmit it first; the seatless request moves
to the front lane. When the biggest holders cannot make room without losing their last
seat, nothing is preempted (a claim that cannot place it would only churn) and it waits.

One claim a step, and a client request never loses its last seat, so the swap cannot
repeat: the new holder has a seat. Once admitted, the scheduler keeps it safe from the
preemption a growing batch causes: running sequences are served fewest-seats-first
(`serve_order`), and decode growth preempts from the end, the biggest holder's newest.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.engine.request import Request
from kvserve.engine.waiting_queue import WaitingQueue
from kvserve.kvcache.manager import KVCacheManager


@dataclass(frozen=True)
class Claim:
    """What one step gives a seatless client request: the sequences to preempt (in order)."""

    seatless: Request
    victims: list[Request]


def fair_share_claim(
    running: Sequence[Request],
    waiting: WaitingQueue,
    max_num_seqs: int,
    manager: KVCacheManager,
    chunk_tokens: int,
) -> Claim | None:
    """The claim of the first seatless waiting request, or None (nothing to take).

    Its need: the blocks of a first chunk of up to `chunk_tokens` (the step's budget);
    each victim counts the blocks preempting it returns to the free pool (those it alone
    holds). None where no client request holds two seats, no waiting request is
    seatless, it lacks neither a seat nor blocks, or room cannot be made for it."""
    if not waiting or not running:
        return None
    if len(running) < max_num_seqs and manager.num_free_blocks >= manager.blocks_for_tokens(
        chunk_tokens
    ):
        return None  # a seat is free and the blocks hold any first chunk: nothing to claim
    seats = Counter(r.client_id for r in running)
    if seats.most_common(1)[0][1] < 2:
        return None  # every client request holds one seat: none has one to give
    seatless = waiting.first_without_seat(seats)
    if seatless is None:
        return None
    need_seat = len(running) >= max_num_seqs
    first_chunk = min(len(seatless.token_ids), chunk_tokens)
    shortfall = manager.blocks_for_tokens(first_chunk) - manager.num_free_blocks
    if not need_seat and shortfall <= 0:
        return None  # a seat and blocks are free: it is admitted in its turn
    # Only from client requests no more urgent than it (--scheduling-policy priority).
    held = Counter(r.client_id for r in running if r.priority >= seatless.priority)
    newest: dict[str, list[Request]] = {}
    for r in running:
        if r.client_id in held:
            newest.setdefault(r.client_id, []).append(r)
    victims: list[Request] = []
    while need_seat or shortfall > 0:
        if not held:
            return None
        holder, count = held.most_common(1)[0]
        if count < 2:
            return None  # only last seats are left: taking one would repeat the swap
        victim = newest[holder].pop()
        held[holder] -= 1
        victims.append(victim)
        need_seat = False
        shortfall -= manager.num_releasable_blocks(victim.request_id)
    return Claim(seatless, victims)


def serve_order(running: list[Request]) -> None:
    """Order the running sequences in place: the most urgent priority first, then the
    client requests holding the fewest seats, each keeping its admission order. Decode
    growth preempts from the end, so a batch gives up its newest sequence before a
    single request admitted after it loses its only one. A no-op while every client
    request holds one seat at one priority (the common case keeps admission order)."""
    seats = Counter(r.client_id for r in running)
    one_level = len({r.priority for r in running}) < 2
    if one_level and (len(seats) < 2 or seats.most_common(1)[0][1] < 2):
        return
    running.sort(key=lambda r: (r.priority, seats[r.client_id]))
