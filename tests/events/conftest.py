"""Real ZMQ sockets on loopback: each test picks free ports."""

from __future__ import annotations

import pytest

from tests._ports import free_port


class Ports:
    """A PUB and a replay port: the engine's config and the subscriber's addresses."""

    def __init__(self) -> None:
        self.pub = free_port()
        self.replay = free_port()

    def config(self, **extra) -> dict:
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.pub}",
            "replay_endpoint": f"tcp://127.0.0.1:{self.replay}",
            **extra,
        }

    @property
    def connect(self) -> str:
        return f"tcp://127.0.0.1:{self.pub}"

    @property
    def replay_connect(self) -> str:
        return f"tcp://127.0.0.1:{self.replay}"


@pytest.fixture
def ports() -> Ports:
    return Ports()
