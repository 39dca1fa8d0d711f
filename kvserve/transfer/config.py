"""vLLM's `kv_transfer_config`, as far as kvserve's transfer reads it.

`kv_connector` "KvserveConnector" (the default; vLLM's NIXL and P2P connectors are
refused by name), `kv_role` "kv_producer" (serves its blocks on `kv_ip`:`kv_port`),
"kv_consumer" (pulls from the producers in `kv_connector_extra_config.peers`) or
"kv_both" (both). Unknown keys are refused: a typo must not silently turn transfer off.
`kv_port` 0 binds a free port (its endpoint logged; kvserve.ray tells it on). A consumer
with `discover` true may name no peers: it is told of its producers while it runs (on
Ray Serve, with each request, the prefill replica that ran its prompt: producers.py).
A producer keeps each request's blocks in its CPU tier until a consumer has pulled them,
or `hold_seconds` (30) pass (kvserve.offload.cpu_tier; 0: plain LRU).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

ROLES = ("kv_producer", "kv_consumer", "kv_both")
CONNECTOR = "KvserveConnector"
KNOWN = {"kv_connector", "kv_role", "kv_ip", "kv_port", "kv_connector_extra_config"}
EXTRA = {"peers", "timeout_s", "discover", "hold_seconds"}
MAX_HOLD_SECONDS = 3600.0


@dataclass(frozen=True)
class KVTransferConfig:
    kv_role: str
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    """0: a free port, chosen when the producer binds."""
    peers: tuple[str, ...] = field(default_factory=tuple)
    """The producers a consumer pulls from (tcp://host:port); more can be told at run time
    (producers.py: kvserve.ray tells a decode replica of its prefill replicas)."""
    timeout_s: float = 2.0
    """How long a consumer waits for a producer's answer before it recomputes."""
    discover: bool = False
    """A consumer told of (more) producers while it runs."""
    hold_seconds: float = 30.0
    """How long a producer keeps a request's blocks for a pull that has not come (0: not
    kept; memory pressure past the held blocks releases the oldest hold first)."""

    @property
    def produces(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def endpoint(self) -> str:
        host = f"[{self.kv_ip}]" if ":" in self.kv_ip else self.kv_ip
        return f"tcp://{host}:{self.kv_port or '*'}"

    @classmethod
    def from_any(cls, value: Any) -> KVTransferConfig:
        """A dict, or its JSON text; a ValueError names the key that is wrong."""
        if isinstance(value, KVTransferConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"kv_transfer_config is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("kv_transfer_config must be a JSON object")
        unknown = sorted(set(value) - KNOWN)
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown key(s) {', '.join(unknown)}")
        connector = value.get("kv_connector", CONNECTOR)
        if connector != CONNECTOR:
            raise ValueError(
                f"kv_transfer_config: kv_connector {connector!r} is not supported (kvserve "
                f"transfers its own blocks: {CONNECTOR!r})"
            )
        role = value.get("kv_role")
        if role not in ROLES:
            raise ValueError(f"kv_transfer_config: kv_role must be one of {', '.join(ROLES)}")
        extra = value.get("kv_connector_extra_config") or {}
        if not isinstance(extra, dict) or set(extra) - EXTRA:
            raise ValueError(
                f"kv_transfer_config: kv_connector_extra_config takes {', '.join(sorted(EXTRA))}"
            )
        peers = extra.get("peers", [])
        if not isinstance(peers, list) or not all(
            isinstance(p, str) and p.startswith("tcp://") for p in peers
        ):
            raise ValueError("kv_transfer_config: peers must be a list of tcp://host:port")
        discover = extra.get("discover", False)
        if not isinstance(discover, bool):
            raise ValueError("kv_transfer_config: discover must be true or false")
        if role == "kv_consumer" and not peers and not discover:
            raise ValueError(
                "kv_transfer_config: a kv_consumer needs peers (its producers), or discover"
            )
        port = value.get("kv_port", 14579)
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"kv_transfer_config: kv_port must be a port number, got {port!r}")
        timeout = extra.get("timeout_s", 2.0)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise ValueError("kv_transfer_config: timeout_s must be > 0")
        hold = extra.get("hold_seconds", 30.0)
        if (
            isinstance(hold, bool)
            or not isinstance(hold, int | float)
            or not 0 <= hold <= MAX_HOLD_SECONDS
        ):
            raise ValueError(
                f"kv_transfer_config: hold_seconds must be a number from 0 to "
                f"{MAX_HOLD_SECONDS:g}, got {hold!r}"
            )
        ip = str(value.get("kv_ip", "127.0.0.1"))
        return cls(role, ip, port, tuple(peers), float(timeout), discover, float(hold))
