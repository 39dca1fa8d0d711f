"""The scheduler's waiting queue: which waiting request is admitted next.

One client request can expand into many engine requests (`n` completions, a
batch of completions prompts, a batch of embeddings inputs). Admitted in plain
arrival order, a 256-input batch would make every request that arrives after
it wait for all 256; here admission is fair by client request instead:

1. Requests put back in front (preempted ones, those a step deferred, and one a
   seat was taken for: seats.py)
   come first, as they always did: they already waited their turn.
2. Then the lowest `priority` value (vLLM's convention: lower is earlier;
   under the default fcfs policy every request has priority 0).
3. Within one priority, round-robin between client requests (`client_id`) in
   the order each arrived: the next request comes from the client request
   whose turn it is, which then goes to the back of the rotation. A single
   chat queued behind a 256-input batch is admitted after at most one request
   of each client request ahead of it.

The requests of one client request keep their order. The interface is the
subset of `collections.deque` the scheduler uses, so `Scheduler.schedule()`
reads the same: `append` queues by the rule above, `appendleft`/`extendleft`
put back in front, `[0]` and `popleft` are the next request.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from collections.abc import Container, Iterable, Iterator, Sequence

from kvserve.engine.request import Request


class WaitingQueue:
    """Waiting requests: the front lane first, then by priority, round-robin by client."""

    def __init__(self) -> None:
        self._front: deque[Request] = deque()
        self._levels: dict[int, OrderedDict[str, deque[Request]]] = {}
        """priority -> the rotation of client requests (client_id -> its waiting requests)."""
        self._order: list[int] = []
        """The priorities in `_levels`, lowest first."""
        self._members: set[Request] = set()

    # -- adding ------------------------------------------------------------------

    def append(self, request: Request) -> None:
        """Queue a new request behind its own client request's, in its client's turn."""
        if request.priority not in self._levels:
            bisect.insort(self._order, request.priority)
        rotation = self._levels.setdefault(request.priority, OrderedDict())
        rotation.setdefault(request.client_id, deque()).append(request)
        self._members.add(request)

    def appendleft(self, request: Request) -> None:
        """Put `request` back first (a preempted request)."""
        self._front.appendleft(request)
        self._members.add(request)

    def extendleft(self, requests: Iterable[Request]) -> None:
        """Put each back first, as deque.extendleft does (the last given ends first)."""
        for request in requests:
            self.appendleft(request)

    def requeue(self, request: Request) -> None:
        """Put `request` back first among its own client request's, in that client's place
        in the rotation (a seat taken from it: the front lane would give the seat back)."""
        if request.priority not in self._levels:
            bisect.insort(self._order, request.priority)
        rotation = self._levels.setdefault(request.priority, OrderedDict())
        rotation.setdefault(request.client_id, deque()).appendleft(request)
        self._members.add(request)

    def promote(self, request: Request) -> None:
        """Move a waiting request to the front lane (a seat was taken for it)."""
        self.remove(request)
        self.appendleft(request)

    # -- taking ------------------------------------------------------------------

    def __getitem__(self, index: int) -> Request:
        """Only `[0]`: the request `popleft` would return."""
        if index != 0:
            raise IndexError("a WaitingQueue only shows its next request ([0])")
        if self._front:
            return self._front[0]
        if not self._levels:
            raise IndexError("the waiting queue is empty")
        rotation = self._levels[self._order[0]]
        return next(iter(rotation.values()))[0]

    def popleft(self) -> Request:
        """The next request; its client request goes to the back of its rotation."""
        if self._front:
            request = self._front.popleft()
        else:
            if not self._levels:
                raise IndexError("the waiting queue is empty")
            rotation = self._levels[self._order[0]]
            client, queue = next(iter(rotation.items()))
            request = queue.popleft()
            if queue:
                rotation.move_to_end(client)
            else:
                self._drop(request.priority, client)
        self._members.discard(request)
        return request

    def remove(self, request: Request) -> None:
        """Drop a waiting request (aborted); a ValueError if it is not here, as deque's."""
        if request not in self._members:
            raise ValueError("the request is not waiting")
        self._members.discard(request)
        if request in self._front:
            self._front.remove(request)
            return
        queue = self._levels[request.priority][request.client_id]
        queue.remove(request)
        if not queue:
            self._drop(request.priority, request.client_id)

    def _drop(self, priority: int, client: str) -> None:
        """Forget a client request with nothing left waiting (and its level, if empty)."""
        rotation = self._levels[priority]
        del rotation[client]
        if not rotation:
            del self._levels[priority]
            self._order.remove(priority)

    # -- reading -----------------------------------------------------------------

    def first_without_seat(self, seated: Container[str]) -> Request | None:
        """The first request, in `popleft` order, of a client request not in `seated` whose
        grammar (if any) is ready; only the head of each client's queue is looked at."""
        for request in self._front:
            if request.client_id not in seated and ready(request):
                return request
        for level in self._order:
            for client, queue in self._levels[level].items():
                if client not in seated and ready(queue[0]):
                    return queue[0]
        return None

    def __contains__(self, request: object) -> bool:
        return request in self._members

    def __len__(self) -> int:
        return len(self._members)

    def __bool__(self) -> bool:
        return bool(self._members)

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request, in the order `popleft` would return them now."""
        yield from self._front
        for level in self._order:
            queues = [deque(q) for q in self._levels[level].values()]
            while queues:
                for queue in queues:
                    yield queue.popleft()
                queues = [q for q in queues if q]


def adapter_fits(request: Request, running: Sequence[Request], max_loras: int | None) -> bool:
    """Its LoRA adapter runs already, or fewer than `max_loras` adapters do: a step never
    needs more adapters than the runner has slots for (kvserve.lora.slots)."""
    if request.lora is None or max_loras is None:
        return True
    adapters = {r.lora_name for r in running if r.lora is not None}
    return request.lora_name in adapters or len(adapters) < max_loras


def ready(request: Request) -> bool:
    """Whether its grammar, if any, has compiled."""
    return request.grammar is None or request.grammar.ready
