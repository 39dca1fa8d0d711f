"""The router side of `simulate --replicas`: what each replica holds, its load, predictions.

It knows only what a live router can know: each replica's KV events (one
batch per step, straight from the engine's sink, applied to that replica's
`EngineView` of a `PrefixIndex`; never the manager itself), the requests it
sent, and the outputs that came back. Loads follow from those: running =
sent and not finished; queued prefill = prompt tokens sent minus predicted
hits, until the request's first token.

A predicted hit is exact when it is made (the view is current up to the
last step), and stays exact until admission unless a block is evicted in
between, or a request still in its prefill registers blocks this request
would hit too. The router rules out the second: a request whose prefix runs
past its predicted hit into a block that an in-flight request (sent, no
first token yet) shares with it waits until that request's first token, so
it is routed, and predicted, knowing where that prefix went. Other requests
pass it. Each first admission's reported hit (`num_cached_tokens`) is
checked against the prediction.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvserve.events.index import PrefixIndex
from kvserve.kvcache.event_metadata import kv_events_metadata
from kvserve.kvcache.event_sink import KVEventSink
from kvserve.kvcache.events import KVEventBatch
from kvserve.kvcache.manager import KVCacheManager
from kvserve.outputs import RequestOutput
from kvserve.routing import Choice, Policy, ReplicaLoad


@dataclass(slots=True)
class Sent:
    """A request the router sent, until it finishes."""

    replica: int
    prompt: list[int]
    predicted: int
    output: list[int] = field(default_factory=list)
    first_token: bool = False


@dataclass(slots=True)
class ReplicaCounts:
    """The router's bookkeeping for one replica."""

    running: int = 0
    queued_prefill_tokens: int = 0
    requests: int = 0
    first_prompt_tokens: int = 0
    """Prompt tokens of requests whose first token came."""
    first_hit_tokens: int = 0
    """Hit tokens those requests reported (first admission, and later chunks before any
    preemption: what `num_cached_tokens` counts)."""
    exact: int = 0
    wrong: int = 0
    hit_less: int = 0
    """Wrong predictions where the replica hit less: blocks evicted before admission."""


class SimRouter:
    """Routes with `policy` over replicas' event-fed views; checks its own predictions."""

    def __init__(self, policy: Policy, managers: Sequence[KVCacheManager]) -> None:
        self.policy = policy
        self.block_size = managers[0].block_size
        self.index = PrefixIndex()
        self._sinks: list[KVEventSink] = []
        for replica, manager in enumerate(managers):
            sink = KVEventSink(manager.block_size)
            manager.attach_events(sink)
            self._sinks.append(sink)
            self.index.add_engine(replica, kv_events_metadata(manager))
        self.counts = [ReplicaCounts() for _ in managers]
        self.sent: dict[str, Sent] = {}
        self._in_flight: dict[tuple[int, ...], set[str]] = {}
        """First hash block's tokens -> requests sent that await their first token."""

    def collect(self, replica: int) -> None:
        """Apply the step's events of `replica` (one batch) to its view."""
        events = self._sinks[replica].take()
        if events:
            self.index.apply(replica, KVEventBatch(time.time(), events))

    def choose(self, prompt: list[int]) -> Choice | None:
        """The policy's choice for `prompt`, or None: it waits for an in-flight prefix."""
        matched = self.index.match(prompt)
        hits = [matched[replica] for replica in range(len(self.counts))]
        if self._shares_in_flight_prefix(prompt, hits):
            return None
        loads = [ReplicaLoad(c.running, c.queued_prefill_tokens) for c in self.counts]
        return self.policy.choose(len(prompt), hits, loads)

    def _shares_in_flight_prefix(self, prompt: list[int], hits: list[int]) -> bool:
        """True when an in-flight request shares `prompt` past the hit on its replica.

        Only such a request can register blocks that make this prompt hit more
        than predicted (every hit is a run from the left).
        """
        bs = self.block_size
        for rid in self._in_flight.get(tuple(prompt[:bs]), ()):
            other = self.sent[rid]
            end = hits[other.replica] + bs
            if end <= min(len(prompt), len(other.prompt)) and prompt[:end] == other.prompt[:end]:
                return True
        return False

    def sent_to(self, request_id: str, prompt: list[int], choice: Choice) -> None:
        """`request_id` went to `choice.replica`: count its load, watch its prefix."""
        self.sent[request_id] = Sent(choice.replica, prompt, choice.predicted_hit_tokens)
        counts = self.counts[choice.replica]
        counts.running += 1
        counts.requests += 1
        counts.queued_prefill_tokens += len(prompt) - choice.predicted_hit_tokens
        self._in_flight.setdefault(tuple(prompt[: self.block_size]), set()).add(request_id)

    def received(self, output: RequestOutput) -> list[int] | None:
        """A (DELTA) output came back; the request's output tokens once it finished."""
        sent = self.sent[output.request_id]
        new = output.outputs[0].token_ids
        counts = self.counts[sent.replica]
        if new and not sent.first_token:
            sent.first_token = True
            counts.queued_prefill_tokens -= len(sent.prompt) - sent.predicted
            key = tuple(sent.prompt[: self.block_size])
            self._in_flight[key].discard(output.request_id)
            if not self._in_flight[key]:
                del self._in_flight[key]
            counts.first_prompt_tokens += len(sent.prompt)
            counts.first_hit_tokens += output.num_cached_tokens
            if output.num_cached_tokens == sent.predicted:
                counts.exact += 1
            else:
                counts.wrong += 1
                counts.hit_less += output.num_cached_tokens < sent.predicted
        sent.output.extend(new)
        if not output.finished:
            return None
        counts.running -= 1
        del self.sent[output.request_id]
        return sent.output
