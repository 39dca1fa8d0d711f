"""KV cache events over ZMQ: the engine's publisher, a subscriber and a router's prefix index.

The event types live in `kvserve.kvcache.events` (pure Python); this room adds
the transport (pyzmq) and what a consumer builds from the stream.
"""

from kvserve.events.config import KVEventsConfig
from kvserve.events.engine_events import EngineKVEvents, make_engine_events
from kvserve.events.index import EngineView, PrefixIndex
from kvserve.events.publisher import ZmqEventPublisher
from kvserve.events.subscriber import KVEventSubscriber, ReplayUnavailable

__all__ = [
    "EngineKVEvents",
    "EngineView",
    "KVEventSubscriber",
    "KVEventsConfig",
    "PrefixIndex",
    "ReplayUnavailable",
    "ZmqEventPublisher",
    "make_engine_events",
]
