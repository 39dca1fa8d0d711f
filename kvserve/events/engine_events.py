"""Wires one engine's KV manager to a publisher: per-step batches and snapshots.

The engine runs each step holding `lock` and calls `end_step()` before
releasing it. A snapshot (on a subscriber's resync request, from the
publisher's thread) takes the same lock, so it always sees the cache between
steps, with every earlier event already published: it is valid after exactly
`publisher.last_seq`.
"""

from __future__ import annotations

import threading
from typing import Any

from kvserve.events.config import KVEventsConfig
from kvserve.events.publisher import ZmqEventPublisher
from kvserve.events.tier_events import TierEvents
from kvserve.kvcache.event_metadata import kv_events_metadata
from kvserve.kvcache.event_sink import KVEventSink
from kvserve.kvcache.event_snapshot import snapshot_events
from kvserve.kvcache.events import KVEvent
from kvserve.kvcache.manager import KVCacheManager


class EngineKVEvents:
    """The sink attached to `manager`, the lock around steps, and the publisher."""

    def __init__(
        self, manager: KVCacheManager, config: KVEventsConfig, extra: dict[str, Any] | None = None
    ) -> None:
        self.manager = manager
        self.config = config
        self.sink = KVEventSink(manager.block_size, int_block_hashes=config.int_block_hashes)
        self.metadata: dict[str, Any] = kv_events_metadata(manager, config.int_block_hashes)
        self.metadata.update(extra or {})  # the KV transfer's endpoints (kvserve.transfer)
        self.lock = threading.Lock()
        self.publisher = ZmqEventPublisher(
            config, snapshot_fn=self.snapshot, metadata=self.metadata
        )
        manager.attach_events(self.sink)
        self.tiers: TierEvents | None = None
        """Events of the external tiers, once `watch_tiers` is called."""

    def watch_tiers(self, store: Any) -> None:
        """Also publish what an offload TierStack stores and evicts (medium CPU / STORAGE)."""
        self.tiers = TierEvents(self.sink)
        store.listener = self.tiers

    def end_step(self) -> int | None:
        """Publish what the step recorded (nothing when it recorded nothing); hold `lock`."""
        events = self.sink.take()
        if self.tiers is not None:
            events.extend(self.tiers.take())
        if not events:
            return None
        return self.publisher.publish(events)

    def snapshot(self) -> tuple[int, list[KVEvent]]:
        """(seq, events): everything cached, valid after batch `seq`."""
        with self.lock:
            self.end_step()
            events = snapshot_events(self.manager, self.config.int_block_hashes, self.sink.medium)
            if self.tiers is not None:
                events.extend(self.tiers.snapshot())
            return self.publisher.last_seq, events

    def close(self) -> None:
        if self.manager.pool.events is self.sink:
            self.manager.attach_events(None)
        self.publisher.close()


def make_engine_events(
    manager: KVCacheManager,
    config: KVEventsConfig | dict[str, Any] | str | None,
    extra: dict[str, Any] | None = None,
) -> EngineKVEvents | None:
    """An `EngineKVEvents` when the config enables a ZMQ publisher, else None (no cost);
    `extra`: more metadata keys."""
    cfg = KVEventsConfig.from_any(config)
    return EngineKVEvents(manager, cfg, extra) if cfg.active else None
