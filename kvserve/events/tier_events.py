"""Events for what the external tiers hold: `medium` "CPU" or "STORAGE".

The tiers store one payload per (group, hash block), so each event names
exactly what a hit can load, at the size it can be loaded (vLLM #57159). A
listener on the TierStack records them: disk writes come from the store's
background thread, hence the lock. It also remembers each stored block's
event, so a resync snapshot can advertise the tiers' content again. Blocks a
previous process saved are not advertised (their tokens are not known here)
until this process stores them again: a router then under-estimates, never
over-estimates.
"""

from __future__ import annotations

import threading
from typing import Any

from kvserve.kvcache.event_sink import KVEventSink
from kvserve.kvcache.events import BlockRemoved, BlockStored, KVEvent, wire_hash


class TierEvents:
    """TierListener for kvserve.offload.store.TierStack; drained by the engine's events."""

    def __init__(self, template: KVEventSink) -> None:
        self._template = template
        self._sinks: dict[str, KVEventSink] = {}
        self._held: dict[str, dict[bytes, BlockStored]] = {}
        self._lock = threading.Lock()

    def _sink(self, medium: str) -> KVEventSink:
        sink = self._sinks.get(medium)
        if sink is None:
            t = self._template
            sink = KVEventSink(t.hash_block_size, t.int_block_hashes, medium, t.group_kinds)
            self._sinks[medium] = sink
            self._held[medium] = {}
        return sink

    def tier_stored(self, medium: str, key: bytes, seq: Any, index: int) -> None:
        hb = self._template.hash_block_size
        with self._lock:
            sink = self._sink(medium)
            sink.stored(key[0], seq, index, seq.token_ids[index * hb : (index + 1) * hb])
            # One event per block, for snapshots (runs are split again here).
            run = sink.events[-1]
            assert isinstance(run, BlockStored)
            h = run.block_hashes[-1]
            self._held[medium][key] = BlockStored(
                block_hashes=[h],
                parent_block_hash=run.parent_block_hash
                if len(run.block_hashes) == 1
                else run.block_hashes[-2],
                token_ids=run.token_ids[-hb:],
                block_size=hb,
                lora_id=None,
                medium=medium,
                lora_name=run.lora_name,
                extra_keys=None if run.extra_keys is None else [run.extra_keys[-1]],
                group_idx=run.group_idx,
                kv_cache_spec_kind=run.kv_cache_spec_kind,
                kv_cache_spec_sliding_window=run.kv_cache_spec_sliding_window,
            )

    def tier_removed(self, medium: str, keys: list[bytes]) -> None:
        with self._lock:
            sink = self._sink(medium)
            held = self._held[medium]
            for key in keys:
                if held.pop(key, None) is None:
                    continue  # never advertised (saved by an earlier process)
                sink.events.append(
                    BlockRemoved(
                        block_hashes=[wire_hash(key[1:], sink.int_block_hashes)],
                        medium=medium,
                        group_idx=key[0],
                    )
                )

    def take(self) -> list[KVEvent]:
        """Events recorded since the last call, tier by tier."""
        with self._lock:
            events: list[KVEvent] = []
            for sink in self._sinks.values():
                events.extend(sink.take())
            return events

    def snapshot(self) -> list[KVEvent]:
        """A BlockStored for each advertised block still held (parents first per medium)."""
        with self._lock:
            return [e for held in self._held.values() for e in held.values()]
