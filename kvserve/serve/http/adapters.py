"""The LoRA adapters a server serves by name: `--lora-modules`, then load and unload.

A request's `model` picks one (vLLM's way): the table maps each served name to the
LoRARequest the engine runs it with. Event-loop owned: handlers alone read and
change it, so it needs no lock; resolving an adapter (reading its files, checking
its weights against the base model) runs on the engine thread
(EngineThread.load_adapter), never here. An unloaded name is gone from the table
at once; requests already submitted keep their LoRARequest and finish with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.lora.request import LoRARequest

MAX_SERVED_ADAPTERS = 256
"""Names one server serves at most (each a few hundred bytes here; the weights of at most
max_cpu_loras stay loaded): a bound on what load requests can make it keep."""


@dataclass(slots=True, frozen=True)
class ServedAdapter:
    request: LoRARequest
    identity: str
    """Its content digest when loaded (Adapter.identity): its key in block hashes."""
    parent: str
    """The base model's name /v1/models lists it under."""


class ServedAdapters:
    """Served name -> adapter, in the order they were added; each load a new id."""

    def __init__(self, base_name: str) -> None:
        self.base_name = base_name
        self._by_name: dict[str, ServedAdapter] = {}
        self._pending: set[str] = set()
        """Names whose load is running on the engine thread (a second load of one is a 400)."""
        self._next_id = 1

    def __len__(self) -> int:
        return len(self._by_name)

    def get(self, name: str) -> ServedAdapter | None:
        return self._by_name.get(name)

    def names(self) -> list[str]:
        return list(self._by_name)

    def served(self) -> list[ServedAdapter]:
        return list(self._by_name.values())

    def reserve(self, name: str, path: str) -> LoRARequest:
        """A new LoRARequest for a name not served (ValueError: taken, or too many)."""
        if name == self.base_name or name in self._by_name or name in self._pending:
            raise ValueError(f"the model name {name!r} is already served")
        if len(self._by_name) + len(self._pending) >= MAX_SERVED_ADAPTERS:
            raise ValueError(f"{MAX_SERVED_ADAPTERS} adapters are served already; unload one")
        self._pending.add(name)
        request = LoRARequest(name, self._next_id, path)
        self._next_id += 1
        return request

    def release(self, name: str) -> None:
        """A reserved name whose load failed."""
        self._pending.discard(name)

    def add(self, request: LoRARequest, identity: str, parent: str | None = None) -> None:
        """Serve a reserved name (its adapter resolved to `identity`)."""
        self._pending.discard(request.lora_name)
        self._by_name[request.lora_name] = ServedAdapter(
            request, identity, parent or self.base_name
        )

    def remove(self, name: str) -> ServedAdapter:
        """Stop serving `name` (KeyError when it is not served)."""
        return self._by_name.pop(name)

    def metadata(self) -> list[dict[str, str]]:
        """/kv-metadata's `lora_adapters`: what a router hashes an adapter request's blocks with."""
        return [
            {"name": name, "identity": served.identity, "path": served.request.lora_path}
            for name, served in self._by_name.items()
        ]
