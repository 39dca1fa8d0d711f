"""Prefill on one engine, decode on another: a request's prompt first runs on a prefill engine.

With `kvserve route --prefill URL ... --decode URL ...`, a completions or chat request
is first sent, as a one-token, non-streamed copy, to the prefill engine with the best
predicted hit (the policy, over the prefill engines alone); its blocks then sit in that
engine's CPU tier, served to the decode engines (kvserve.transfer). The request itself
then goes, unchanged, to a decode engine (forward.py, which never picks a prefill
engine): the blocks its own cache lacks it pulls from the producer, and it answers the
client, streaming or not. Whatever goes wrong with the prefill (an engine down, a 4xx or
5xx, no answer within `prefill_timeout`: the call is left, which aborts it there) only
costs the decode engine the prompt's computation: the answer is the same, and
`kvserve:router_prefill_fallbacks_total` counts it by reason. The decode engine's
reported cached tokens include the blocks it pulls: once
the prefill has answered, the prompts are matched again over the events (the prefill
engine's CPU tier now holds their blocks, and the event mirror counts what a decode
engine would pull from its producers: kvserve.events.index), so that prediction is
checked exactly like any other; after a failed prefill it is not checked.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
from fastapi import Request

from kvserve.router.forward import NOT_SENT, Prediction
from kvserve.router.state import RouterState

log = logging.getLogger("kvserve.router")

TIMEOUT = 10.0
"""Seconds the events may take to show the prefill (as app.py's prediction)."""
PREFILL_ONLY = {"max_tokens": 1, "max_completion_tokens": 1, "stream": False, "n": 1}
DROPPED = ("stream_options", "logprobs", "top_logprobs", "best_of", "min_tokens")


def disaggregated(state: RouterState) -> bool:
    return any(r.role == "prefill" for r in state.replicas)


def worth_prefilling(num_tokens: int, decode_hit: int, min_tokens: int) -> bool:
    """A prompt with fewer tokens than `min_tokens` not yet cached on a decode engine is
    computed there: on a prefill engine it would wait behind long prompts for less work than
    the decode engine does itself (also kvserve.ray's split)."""
    return num_tokens - decode_hit >= min_tokens


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The one-token, non-streamed copy of a request that a prefill engine runs."""
    copy = {k: v for k, v in body.items() if k not in DROPPED}
    copy.update(PREFILL_ONLY)
    if "max_completion_tokens" not in body:
        copy.pop("max_completion_tokens")
    return copy


async def prefill_first(
    request: Request, state: RouterState, path: str, body: Any, prediction: Prediction
) -> None:
    """Run `body`'s prompt on the best prefill engine (nothing happens where none is up, or
    for a prompt of fewer than `prefill_min_tokens` not yet cached on a decode engine: it
    would wait behind long prompts there for less than the decode engine computes itself)."""
    if not isinstance(body, dict):
        return
    decode_hit = max((prediction.hit(r.index) for r in state.replicas if r.role != "prefill"),
                     default=0)  # fmt: skip
    if not worth_prefilling(prediction.num_tokens, decode_hit, state.prefill_min_tokens):
        return
    loads = [r.load(r.role != "prefill") for r in state.replicas]
    hits = [prediction.hit(r.index) for r in state.replicas]
    try:
        choice = state.policy.choose(prediction.num_tokens, hits, loads)
    except ValueError:
        return  # no prefill engine is up: the decode engine computes the prompt
    replica = state.replicas[choice.replica]
    copy = prefill_body(body)
    headers = {k: v for k, v in request.headers.items() if k.lower() not in NOT_SENT}
    replica.running += 1
    state.metrics.requests.labels(replica.url).inc()
    prediction.checked = False  # until matched again after a prefill that answered
    fallbacks = state.metrics.prefill_fallbacks
    try:
        # Past the deadline the call is cancelled: its connection closes, which aborts the
        # request on the prefill engine (as a client gone does).
        answer = await asyncio.wait_for(
            state.http().post(f"{replica.url}{path}", json=copy, headers=headers),
            state.prefill_timeout,
        )
    except TimeoutError:
        log.warning("prefill on %s took over %gs: the decode engine computes the prompt",
                    replica.url, state.prefill_timeout)  # fmt: skip
        fallbacks.labels(replica.url, "timeout").inc()
        return
    except httpx.HTTPError as exc:
        log.warning("prefill on %s failed (%s): the decode engine computes the prompt",
                    replica.url, type(exc).__name__)  # fmt: skip
        fallbacks.labels(replica.url, "failed").inc()
        return
    finally:
        replica.running -= 1
    if answer.status_code != 200:
        log.info("prefill on %s answered %d: the decode engine computes the prompt",
                 replica.url, answer.status_code)  # fmt: skip
        fallbacks.labels(replica.url, "status").inc()
        return
    await _match_again(state, prediction)


async def _match_again(state: RouterState, prediction: Prediction) -> None:
    """Each replica's hit once the events of the prefill (its blocks stored) are in."""
    if prediction.prompts is None:
        return
    try:
        synced = await asyncio.wait_for(asyncio.wrap_future(state.follower.sync()), TIMEOUT)
        hits = await asyncio.wait_for(
            asyncio.wrap_future(state.follower.predict(prediction.prompts, prediction.extra,
                                                       synced)), TIMEOUT)  # fmt: skip
    except TimeoutError:
        return
    prediction.hits = [hits.get(r.index) if r.caching else 0 for r in state.replicas]
    prediction.checked = True
