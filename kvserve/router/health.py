"""Replicas up and down: /health every `health_interval` seconds, and failures seen in flight.

A replica that fails its check (or a request before any byte) gets no new
request and its events are no longer followed. One that answered a request
with 503 (draining, or its queue full) gets no new request either, its events
still followed, until its /health answers 200 (a draining one answers 503 and
is marked down). When it answers again its
/kv-metadata is read anew (it may have restarted with other settings, but
never with another checkpoint or name: then it stays out) and its view is
rebuilt from scratch: replay from batch 0 if still buffered, else a snapshot.
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from kvserve.router.replicas import Replica, disagreement, parse_info
from kvserve.router.state import RouterState

log = logging.getLogger("kvserve.router")


def follow(state: RouterState, replica: Replica) -> None:
    """Follow the replica's events (those it publishes with a replay socket)."""
    source = replica.event_source()
    if source is not None:
        state.follower.attach(replica.index, source)
    else:
        state.follower.detach(replica.index)


def mark_down(state: RouterState, replica: Replica, reason: str) -> None:
    if replica.healthy:
        log.warning("replica %s is down (%s): no requests go to it", replica.url, reason)
    replica.healthy = False
    state.follower.detach(replica.index)


def mark_refusing(replica: Replica, reason: str) -> None:
    if not replica.refusing:
        log.warning("replica %s refuses requests (%s): none go to it until /health is 200",
                    replica.url, reason)  # fmt: skip
    replica.refusing = True


async def watch(state: RouterState) -> None:
    """Runs while the app does (a task of its lifespan)."""
    while True:
        await asyncio.gather(*(_check(state, r) for r in state.replicas))
        await asyncio.sleep(state.health_interval)


async def _check(state: RouterState, replica: Replica) -> None:
    client = state.http()
    try:
        ok = (await client.get(f"{replica.url}/health", timeout=2)).status_code == 200
    except httpx.HTTPError:
        ok = False
    if not ok:
        mark_down(state, replica, "/health failed")
    elif not replica.healthy:
        await _revive(state, replica)
    elif replica.refusing:
        replica.refusing = False
        log.info("replica %s takes requests again", replica.url)


async def read_info(state: RouterState, replica: Replica, failing: str) -> dict | None:
    """The replica's /kv-metadata, read and checked; None (logged, `failing` saying what
    that costs) where it cannot be read."""
    try:
        return parse_info(replica.url, await state.http().get(f"{replica.url}/kv-metadata"))
    except (httpx.HTTPError, ValueError) as exc:
        log.warning("replica %s: %s: %s", replica.url, failing, exc)
        return None


async def _revive(state: RouterState, replica: Replica) -> None:
    info = await read_info(state, replica, "answers /health but not /kv-metadata")
    if info is None:
        return
    reference = next((r for r in state.replicas if r is not replica), replica)
    problem = disagreement(reference, replica.url, info)
    if problem is not None:
        log.error("replica %s stays out: %s", replica.url, problem)
        return
    replica.info = info
    follow(state, replica)
    replica.healthy = True
    replica.refusing = False
    log.info("replica %s is back", replica.url)
