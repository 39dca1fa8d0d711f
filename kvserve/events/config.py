"""`KVEventsConfig`: written exactly as vLLM users write it (dict or object)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, overload


@dataclass(slots=True)
class KVEventsConfig:
    """vLLM's keys, plus three kvserve extensions at the end.

    An endpoint containing `*` binds (the engine listens); any other connects
    (e.g. to a proxy). The replay socket always binds. Both ports are offset by
    the data-parallel rank, so ranks on one host do not collide.
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    """"zmq" or "null"; default: "zmq" when events are enabled."""
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    """Batches kept for replay."""
    hwm: int = 100_000
    max_queue_size: int = 100_000
    """Batches waiting for the sender thread; beyond it `publish` drops (and counts)."""
    topic: str = ""
    int_block_hashes: bool = True
    """kvserve: block hashes as u64 (vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES); False: bytes."""
    data_parallel_rank: int = 0
    """kvserve: this engine's rank (annotates batches, offsets ports)."""
    bind: bool | None = None
    """kvserve: True binds `endpoint` even without a wildcard (`kvserve serve` binds
    tcp://127.0.0.1:5557 so only this host can read prompts' token ids); None: vLLM's rule."""

    def __post_init__(self) -> None:
        _check_types(self)
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events_config: unknown publisher {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv_events_config: {name} must be >= 1")
        if self.data_parallel_rank < 0:
            raise ValueError("kv_events_config: data_parallel_rank must be >= 0")

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_any(cls, value: KVEventsConfig | dict[str, Any] | str | None) -> KVEventsConfig:
        """Accept an object, a dict (vLLM's keys) or its JSON text; None: disabled."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"kv_events_config is not valid JSON: {exc}") from None
            if not isinstance(value, dict):
                raise ValueError(
                    "kv_events_config must be a JSON object of vLLM's keys, e.g. "
                    f'{{"enable_kv_cache_events": true}}, got {_json_kind(value)}'
                )
        if not isinstance(value, dict):
            raise TypeError("kv_events_config must be a dict, a KVEventsConfig or JSON text")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_events_config: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**value)


_KINDS: dict[str, tuple[type, ...]] = {
    "bool": (bool,),
    "int": (int,),
    "str": (str,),
    "str | None": (str, type(None)),
    "bool | None": (bool, type(None)),
}
_KIND_NAMES = {
    "bool": "true or false",
    "int": "an integer",
    "str": "a string",
    "str | None": "a string or null",
    "bool | None": "true, false or null",
}


def _check_types(config: KVEventsConfig) -> None:
    """Each key's value has its field's type: "yes" is not a bool, 1.5 is not an int.

    JSON and Python spell the same values, so both are checked here; a bool is not
    accepted as an integer either (JSON's true is no buffer size).
    """
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        kind = str(f.type)  # the annotation's text (annotations are strings here)
        kinds = _KINDS[kind]
        wrong = isinstance(value, bool) and bool not in kinds
        if wrong or not isinstance(value, kinds):
            raise ValueError(
                f"kv_events_config: {f.name} must be {_KIND_NAMES[kind]}, got {value!r}"
            )


def _json_kind(value: Any) -> str:
    names = {list: "an array", int: "a number", float: "a number", bool: "a boolean"}
    return names.get(type(value), "a string" if isinstance(value, str) else "null")


@overload
def offset_endpoint_port(endpoint: str, rank: int) -> str: ...
@overload
def offset_endpoint_port(endpoint: str | None, rank: int) -> str | None: ...
def offset_endpoint_port(endpoint: str | None, rank: int) -> str | None:
    """`tcp://host:5557` -> `tcp://host:5557+rank`; other transports get a `_dp<rank>` suffix.
    `tcp://host:*` (any free port) stays: each rank gets its own."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return endpoint if port == "*" else f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"
