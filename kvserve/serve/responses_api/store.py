"""Stored responses: a bounded, least-recently-used map from id to response.

`store: true` (the default, as OpenAI's) keeps a response so that GET
/v1/responses/{id} returns it and `previous_response_id` continues its
conversation. The map is in memory and bounded (`--responses-store-size`):
the least recently used response goes first, so a long-running server's
memory does not grow with its traffic. Owned by the event loop: no lock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

RESPONSES_STORE_SIZE = 1024
"""Stored responses kept by default (`--responses-store-size`)."""


@dataclass(slots=True)
class StoredResponse:
    body: dict[str, Any]
    """The response object as GET answers it."""
    conversation: list[dict[str, Any]]
    """The chat messages of the whole conversation, this response's answer last, without
    its instructions (a continuation gives its own)."""


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"the responses store size must be >= 0, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if self.capacity == 0:
            return
        self._items[response_id] = stored
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None
