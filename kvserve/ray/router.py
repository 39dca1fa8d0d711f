"""`KVServeRequestRouter`: Ray Serve's request router for kvserve replicas, exact by KV events.

It plugs into Serve's request-router API (`request_router_config` of the engine deployment,
as Ray's own PrefixCacheAffinityRouter does) and runs where the handle to the engine
deployment lives: in each ingress replica. There it does what `kvserve route` does, with
the same code:

- follows every replica's KV events with `kvserve.router.follower.EventFollower` (the
  subscribers and the prefix index); a replica advertises where they are in its routing
  stats (replica.py), so no address is ever written down. A replica that leaves (dies, is
  scaled down) has its view dropped; the one Serve starts in its place, or a replica that
  restarted in place (a new boot id), is followed from scratch (replay, else a snapshot);
- holds a body to the replicas' limits (their `limits`, kvserve.request_limits): one they
  refuse unread is not tokenized here either, and gets Serve's choice;
- tokenizes each request's prompts as the replica will (`kvserve.router.prompts`, with the
  checkpoint's tokenizer the replicas advertise), brings every view up to date (a sync round
  started as the request arrives, overlapping the tokenizer) and matches them;
- chooses with kvserve's routing policy (`kvserve.routing`, cache-aware by default) over
  each replica's predicted hit and its load as this router sent it (running; prompt tokens
  less the hit), counted from the choice (requests that arrive together see each other)
  until the answer ends (Serve tells a router no earlier than that);
- sends an adapter request only to replicas that serve the adapter, where they differ
  (kvserve.ray.adapters.serving);
- falls back to Serve's own Power-of-Two choice where it cannot predict: no replica's view in
  sync, not a generation request, or a prompt it cannot read. A replica whose view is not in
  sync while others are counts a hit of 0 for the policy, as in `kvserve route`.

The choice is returned as the first rank, the others as the next (Serve sends there only if
the chosen replica's queue is full). No FIFOMixin: a replica chosen for a request is given
to that request, not to the oldest one waiting.

Serve pickles this module by value to ship the class to the ingress, so it holds no state
of its own at module level: the routing book shared with the ingress is book.py's.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

# Serve's default router, for the fallback: the one private name kvserve uses (Ray exports
# the router API but not its default router; Ray's own experimental routers fall back the
# same way). The `ray[serve]` pin in pyproject moves with tests/ray.
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from kvserve.model.checkpoint.tokenizer import load_tokenizer
from kvserve.ray import book
from kvserve.ray.adapters import fresher, serving
from kvserve.ray.book import ViewStats
from kvserve.request_limits import LimitError, PromptLimits, decode_body
from kvserve.router.follower import EventFollower
from kvserve.router.limits import check_request, loosest
from kvserve.router.prompts import Endpoint, adapter_identities, extra_keys, prompt_token_ids
from kvserve.router.replicas import event_source
from kvserve.routing import Policy, ReplicaLoad, make_policy

log = logging.getLogger("kvserve.ray")
UNSENT_SECONDS = 60.0
KEPT_PROMPTS = 64
"""Prompts the split's predictions keep for their requests' choice (token ids: at most
this many requests' prompts, each under the replicas' max_model_len)."""
GENERATION_PATHS: dict[str, Endpoint] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
}
"""Path -> how its prompt is read: the requests whose hit is predicted."""


@dataclass(slots=True)
class _Followed:
    """One replica as this router knows it."""

    index: int
    """Its number in the follower (never reused: a replica back gets a new one)."""
    boot: str
    info: dict[str, Any]
    running: int = 0
    queued_prefill_tokens: int = 0


@dataclass(slots=True)
class _Prediction:
    num_tokens: int
    hits: dict[ReplicaID, int | None] = field(default_factory=dict)


@dataclass(slots=True)
class _Load:
    """What one request adds to a replica's load, from the choice until its answer ends."""

    replica: ReplicaID
    prefill: int
    since: float = field(default_factory=time.monotonic)


class KVServeRequestRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    def initialize_state(self, policy: str = "cache-aware", **kwargs: Any) -> None:
        self.policy: Policy = make_policy(policy)
        self.follower = EventFollower()
        self.follower.start()
        self.followed: dict[ReplicaID, _Followed] = {}
        self.next_index = 0
        self.tokenizer: Any = None
        self.tokenizer_path: str | None = None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="kvserve-ray-tokenizer")
        self.kept: OrderedDict[tuple[str, bytes], list[list[int]]] = OrderedDict()
        """The split's predictions' prompts, until their request is chosen for."""
        self.predictions: dict[str, _Prediction] = {}
        """Internal request id -> its prediction, from the choice until it is sent."""
        self.loads: dict[str, _Load] = {}
        """Internal request id -> the load it adds, counted from the choice (requests that
        arrive together must see each other) until its answer ends."""
        name = self._deployment_id.name
        book.BOOK.views[name] = self.view_stats
        book.BOOK.predictors[name] = self.best_hit
        book.BOOK.adapter_listeners[name] = self.learn_adapters

    # -- Serve's replica set --------------------------------------------------------

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        current = {r.replica_id: r for r in replicas}
        for replica_id in [r for r in self.followed if r not in current]:
            self._forget(replica_id)
        for replica_id, replica in current.items():
            info = (replica.routing_stats or {}).get("kvserve")
            if not isinstance(info, dict) or "boot" not in info:
                continue  # not advertised yet: Serve's choice until it is
            known = self.followed.get(replica_id)
            if known is not None and known.boot == info["boot"]:
                known.info = fresher(known.info, info)
                continue
            if known is not None:
                self._forget(replica_id)
            self._follow(replica_id, info)

    def learn_adapters(self, adapters: dict[str, Any]) -> None:
        """Replica (Serve's unique id) -> its adapters now and its count of changes, told by
        the ingress after a run-time change (before the routing stats say so): hashed with
        at once (kvserve.ray.adapters)."""
        for replica_id, followed in list(self.followed.items()):
            if replica_id.unique_id in adapters:
                followed.info = {**followed.info, **adapters[replica_id.unique_id]}

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id)

    def _follow(self, replica_id: ReplicaID, info: dict[str, Any]) -> None:
        source = event_source(info, str(info.get("host") or "127.0.0.1"))
        followed = _Followed(self.next_index, info["boot"], info)
        self.next_index += 1
        self.followed[replica_id] = followed
        if source is not None:
            self.follower.attach(followed.index, source)
            log.info("replica %s: following its KV events", replica_id.unique_id)
        if self.tokenizer_path is None and info.get("model"):
            self.tokenizer_path = str(info["model"])
            self.pool.submit(self._load_tokenizer, self.tokenizer_path)

    def _forget(self, replica_id: ReplicaID) -> None:
        followed = self.followed.pop(replica_id, None)
        if followed is not None:
            self.follower.detach(followed.index)
            log.info("replica %s: gone, its view dropped", replica_id.unique_id)

    def _load_tokenizer(self, path: str) -> None:
        try:
            self.tokenizer = load_tokenizer(path)
        except Exception as exc:  # no prediction for chat; completions of token ids still
            log.warning("cannot load the replicas' tokenizer from %s: %s", path, exc)

    def _prompts(
        self, endpoint: Endpoint, body: Any, raw: bytes, keep: bool
    ) -> list[list[int]] | None:
        """On the tokenizer's thread (the only one that touches `kept`), after the tokenizer
        has loaded there. `keep`: the split's prediction, whose request comes back to be
        chosen for (its prompts then taken, not tokenized again)."""
        key = (endpoint, hashlib.blake2b(raw, digest_size=16).digest())
        kept = self.kept.pop(key, None)
        if kept is not None:
            return kept
        prompts = prompt_token_ids(self.tokenizer, endpoint, body)
        if keep and prompts is not None:
            self.kept[key] = prompts
            while len(self.kept) > KEPT_PROMPTS:
                self.kept.popitem(last=False)
        return prompts

    def view_stats(self) -> ViewStats:
        stats: ViewStats = {}
        for replica_id, followed in list(self.followed.items()):
            is_followed, blocks, resyncs = self.follower.stats(followed.index)
            stats[replica_id.unique_id] = (
                is_followed,
                blocks,
                resyncs,
                followed.info.get("kv", {}),
            )
        return stats

    # -- choosing ---------------------------------------------------------------------

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None and candidate_replicas:
            infos = [self._info(r.replica_id) for r in candidate_replicas]
            candidate_replicas = serving(candidate_replicas, infos, pending_request.args)
            try:
                ranks = await self._exact(candidate_replicas, pending_request)
            except Exception as exc:
                log.warning("no prediction for a request (%s): Serve's choice", exc)
                ranks = None
            if ranks is not None:
                return ranks
        return await PowerOfTwoChoicesRequestRouter.choose_replicas(
            self,
            candidate_replicas=candidate_replicas,
            pending_request=pending_request,
        )

    def _info(self, replica_id: ReplicaID) -> dict[str, Any] | None:
        followed = self.followed.get(replica_id)
        return followed.info if followed is not None else None

    async def _predict(
        self, args: list[Any], keep: bool = False
    ) -> tuple[list[list[int]], dict[int, int]] | None:
        """(the prompts, the hit predicted by follower index) of a forwarded request, or None:
        no prediction possible. It touches only what is safe from any thread (the follower's
        futures, the tokenizer's pool), so the ingress may call it on its own loop."""
        followed = list(self.followed.values())
        limits = loosest([PromptLimits.from_dict(f.info.get("limits")) for f in followed])
        forwarded = _forwarded(args, limits)
        if forwarded is None or not followed:
            return None
        endpoint, body = forwarded
        infos = [f.info for f in followed]
        served = infos[0].get("served_model_name")
        extra = extra_keys(body, served, adapter_identities(infos))
        if extra is None:
            return None  # an adapter this router does not know: no prediction
        synced_future = self.follower.sync()  # the round trip overlaps the tokenizer
        loop = asyncio.get_running_loop()
        raw = args[1]
        prompts = await loop.run_in_executor(self.pool, self._prompts, endpoint, body, raw, keep)
        synced = await asyncio.wrap_future(synced_future)
        if prompts is None or not synced:
            return None
        longest = limits.max_model_len if limits is not None else None
        if longest is not None and any(len(p) >= longest for p in prompts):
            return None  # the replica refuses it: nothing to match
        by_index = await asyncio.wrap_future(self.follower.predict(prompts, extra, synced))
        return prompts, by_index

    async def best_hit(self, args: list[Any]) -> tuple[int, int] | None:
        """(prompt tokens, the best hit predicted on any replica) of a forwarded request, or
        None (the ingress's prefill/decode split asks it of the decode replicas)."""
        predicted = await self._predict(args, keep=True)
        if predicted is None:
            return None
        prompts, by_index = predicted
        return sum(len(p) for p in prompts), max(by_index.values(), default=0)

    async def _exact(
        self, candidates: list[RunningReplica], request: PendingRequest
    ) -> list[list[RunningReplica]] | None:
        """Ranks: the policy's choice, then the rest; None: no prediction possible."""
        predicted = await self._predict(request.args)
        if predicted is None:
            return None
        prompts, by_index = predicted
        self._uncount(request.metadata.internal_request_id)  # a choice made again
        hits: list[int | None] = []
        loads: list[ReplicaLoad] = []
        for replica in candidates:
            followed = self.followed.get(replica.replica_id)
            hits.append(by_index.get(followed.index) if followed is not None else None)
            loads.append(
                ReplicaLoad(followed.running, followed.queued_prefill_tokens)
                if followed is not None
                else ReplicaLoad(0, 0)
            )
        if all(hit is None for hit in hits):
            return None
        num_tokens = sum(len(p) for p in prompts)
        choice = self.policy.choose(num_tokens, [hit or 0 for hit in hits], loads)
        internal = request.metadata.internal_request_id
        self.predictions[internal] = _Prediction(
            num_tokens, {r.replica_id: hit for r, hit in zip(candidates, hits, strict=True)}
        )
        chosen = candidates[choice.replica]
        self._count(internal, chosen.replica_id, max(num_tokens - choice.predicted_hit_tokens, 0))
        return [[chosen], [r for r in candidates if r is not chosen]]

    # -- loads ------------------------------------------------------------------------

    def _count(self, internal: str, replica_id: ReplicaID, prefill: int) -> None:
        """The request's load on `replica_id` (moved there if it was counted elsewhere)."""
        self._uncount(internal)
        followed = self.followed.get(replica_id)
        if followed is None:
            return
        followed.running += 1
        followed.queued_prefill_tokens += prefill
        self.loads[internal] = _Load(replica_id, prefill)
        self._expire()

    def _uncount(self, internal: str) -> None:
        load = self.loads.pop(internal, None)
        followed = self.followed.get(load.replica) if load is not None else None
        if load is not None and followed is not None:
            followed.running -= 1
            followed.queued_prefill_tokens -= load.prefill

    def _expire(self) -> None:
        """A request chosen for but never sent (cancelled while waiting) is not told of:
        its load goes after UNSENT_SECONDS."""
        now = time.monotonic()
        for internal in [i for i, load in self.loads.items() if now - load.since > UNSENT_SECONDS]:
            if internal in self.predictions:
                del self.predictions[internal]
                self._uncount(internal)

    # -- what happened to the request ---------------------------------------------------

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        internal = pending_request.metadata.internal_request_id
        prediction = self.predictions.pop(internal, None)
        predicted = prediction.hits.get(replica_id) if prediction is not None else None
        num_tokens = prediction.num_tokens if prediction is not None else 0
        load = self.loads.get(internal)
        if load is None or load.replica != replica_id:
            self._count(internal, replica_id, max(num_tokens - (predicted or 0), 0))
        book.BOOK.sent(pending_request.metadata.request_id, replica_id.unique_id, predicted)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.predictions.pop(internal_request_id, None)
        self._uncount(internal_request_id)


def _forwarded(args: list[Any], limits: PromptLimits | None = None) -> tuple[Endpoint, Any] | None:
    """(its endpoint, the JSON body) of a generation request forwarded by the ingress, else
    None: also for a body the replicas refuse before tokenizing it (`limits`, theirs), which
    is then not tokenized here either."""
    if len(args) != 2 or not isinstance(args[0], dict) or not isinstance(args[1], bytes):
        return None
    scope, raw = args
    endpoint = GENERATION_PATHS.get(scope.get("path", ""))
    if endpoint is None or scope.get("method") != "POST":
        return None
    try:  # depth-bounded: a body nested 100,000 deep is the replica's 400, not a crash here
        body = decode_body(raw)
        check_request(limits, endpoint, body)
    except LimitError:
        return None
    return endpoint, body
