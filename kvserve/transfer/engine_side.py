"""Where an engine's tiers meet the transfer: the producer's server, the consumer's tiers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvserve.offload.options import parse_offload
from kvserve.offload.store import TierStack
from kvserve.offload.tiers import Tier
from kvserve.transfer.config import KVTransferConfig

if TYPE_CHECKING:
    from kvserve.transfer.server import BlockServer


def transfer_config(args: Any) -> KVTransferConfig | None:
    """The engine's `kv_transfer_config`, read (None: no transfer); a producer must keep
    its blocks in a CPU tier (`offload` cpu:SIZE)."""
    value = getattr(args, "kv_transfer_config", None)
    if value is None:
        return None
    config = KVTransferConfig.from_any(value)
    offload = getattr(args, "offload", None)
    tiers = parse_offload(offload) if offload else []
    if config.produces and not any(option.kind == "cpu" for option in tiers):
        raise ValueError(
            "kv_transfer_config: a kv_producer keeps its blocks for the consumers in a CPU "
            "tier: give offload cpu:SIZE"
        )
    return config


def remote_tiers(
    config: KVTransferConfig | None, fingerprint: bytes, largest_payload: int
) -> list[Tier]:
    """A consumer's producers, as one read-only tier after its own; `largest_payload`: the
    largest block it stores (a larger frame from a producer is refused unread)."""
    if config is None or not config.consumes:
        return []
    from kvserve.transfer.producers import Producers

    return [Producers(config.peers, fingerprint, config.timeout_s, largest_payload)]


def serve_blocks(store: TierStack, fingerprint: bytes, config: KVTransferConfig) -> BlockServer:
    """A producer serves its memory tier's blocks until the store closes."""
    from kvserve.transfer.server import BlockServer

    server = BlockServer(store, fingerprint, config.endpoint)
    store.closers.append(server.close)
    return server
