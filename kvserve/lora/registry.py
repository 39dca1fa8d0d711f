"""The engine's adapters by request: each `LoRARequest` resolved once per content.

Resolving reads an adapter's files (its digest) and checks its weights against the
base model; both are remembered until the files change (their size and modification
time), so a request naming a known adapter costs a few `stat` calls, and a name
whose files were rewritten resolves to the new content: its blocks are new ones.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvserve.lora.request import CONFIG_FILE, WEIGHTS_FILE, Adapter, LoRARequest, resolve_adapter


class AdapterRegistry:
    """LoRARequest -> Adapter, checked by `check` (the runner: the weights fit the model)."""

    def __init__(self, max_lora_rank: int, check: Callable[[Adapter], None]) -> None:
        self.max_lora_rank = max_lora_rank
        self._check = check
        self._known: dict[tuple[str, str], tuple[tuple[int, ...], Adapter]] = {}

    @classmethod
    def for_runner(cls, runner: object, max_lora_rank: int) -> AdapterRegistry:
        """Adapters checked by `runner`'s LoRA slots (a model runner built with max_loras)."""
        slots = getattr(runner, "lora", None)
        if slots is None:
            raise ValueError("enable_lora needs a model runner (this runner applies no adapters)")
        return cls(max_lora_rank, slots.load)

    def resolve(self, request: LoRARequest) -> Adapter:
        """The adapter `request` names (ValueError: which file or field is wrong)."""
        if not isinstance(request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        key = (request.lora_name, request.lora_path)
        stamp = _stamp(Path(request.lora_path).expanduser())
        known = self._known.get(key)
        if known is not None and known[0] == stamp:
            return known[1]
        adapter = resolve_adapter(request, self.max_lora_rank)
        self._check(adapter)
        self._known[key] = (stamp, adapter)
        return adapter

    def forget(self, name: str) -> None:
        """Drop what is remembered under `name` (a server unloaded it): names a server loads
        and unloads at run time do not pile up here."""
        for key in [k for k in self._known if k[0] == name]:
            del self._known[key]


def _stamp(path: Path) -> tuple[int, ...]:
    stamp: list[int] = []
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        try:
            st = (path / name).stat()
        except OSError:
            return ()
        stamp += [st.st_size, st.st_mtime_ns, st.st_ino]
    return tuple(stamp)
