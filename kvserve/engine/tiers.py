"""The engine's side of the external KV tiers: the connector, and the step around it.

Built from the `offload` option when the engine has a model checkpoint (its
fingerprint keys what the tiers hold), or over the model-free runner's own
K/V in `simulate`. Each step loads the scheduled
external hits into their blocks before the runner, and offers what the step
computed to the tiers after it, reading only the step plans and plain
request data.
"""

from __future__ import annotations

import atexit
from dataclasses import dataclass
from typing import Any

from kvserve.engine.engine_args import EngineArgs
from kvserve.engine.scheduler import SchedulerOutput
from kvserve.kvcache.hashing import HASH_FUNCTIONS
from kvserve.kvcache.manager import KVCacheManager


@dataclass(slots=True)
class TierRecord:
    """What the tiers' events need of a request whose blocks are saved (plain data)."""

    block_hashes: Any
    token_ids: list[int]
    lora_name: str | None
    cache_salt: str | None
    num_prompt_tokens: int


class EngineTiers:
    """Owns the offload connector and the runner's block reader/writer."""

    def __init__(self, runner: Any, args: EngineArgs) -> None:
        from kvserve.offload.build import build_store
        from kvserve.offload.connector import OffloadConnector, block_key
        from kvserve.transfer.engine_side import remote_tiers, serve_blocks, transfer_config

        if not args.enable_prefix_caching:
            raise ValueError("offload needs prefix caching (its keys are the block hashes)")
        if not args.offload and not args.kv_transfer_config:
            raise ValueError("offload needs an offload spec, e.g. cpu:8GiB")
        own_io = getattr(runner, "kv_block_io", None)
        if own_io is not None:  # the model-free runner (simulate): its own K/V and fingerprint
            self.block_io, fingerprint = own_io(args.block_size, args.hash_fn, args.hash_seed)
        else:
            self.block_io, fingerprint = _model_io(runner, args)
        # The largest payload one key stores: a hash block of an attention group, or a
        # state group's whole page. A tier that cannot hold it is refused at start.
        largest = max(
            self.block_io.payload_bytes(g, None if spec.kind == "mamba" else args.block_size)
            for g, spec in enumerate(runner.kv_cache_specs)
        )
        key_bytes = len(block_key(0, HASH_FUNCTIONS[args.hash_fn](b"")))
        transfer = transfer_config(args)
        remote = remote_tiers(transfer, fingerprint, largest)
        hold = transfer.hold_seconds if transfer and transfer.produces else 0.0
        store = build_store(args.offload, fingerprint, largest, key_bytes, remote, hold)
        self.transfer = transfer
        self.server = (
            serve_blocks(store, fingerprint, transfer) if transfer and transfer.produces else None
        )
        atexit.register(store.close)  # queued disk writes land before the process exits
        self.connector = OffloadConnector(store, runner.kv_cache_specs, args.block_size)

    def load(self) -> None:
        """Before the runner: this step's external payloads into their blocks."""
        self.connector.load(self.block_io)

    def save(self, out: SchedulerOutput, manager: KVCacheManager) -> None:
        """After the runner: what each scheduled request computed, offered to the tiers."""
        for chunk in out.chunks:
            req = chunk.request
            rid = req.request_id
            record = TierRecord(
                manager.block_hashes(rid),
                req.token_ids,
                req.lora_name,
                req.cache_salt,
                req.num_prompt_tokens,
            )
            self.connector.save(self.block_io, manager.step_plan(rid), record)

    @property
    def producers(self) -> Any:
        """A consumer's producers (kvserve.transfer.producers.Producers), else None."""
        from kvserve.transfer.producers import Producers

        return next((t for t in self.connector.store.tiers if isinstance(t, Producers)), None)

    def transfer_stats(self) -> dict[str, float] | None:
        """KV transfer's counters (kvserve.transfer); None without kv_transfer_config."""
        if self.transfer is None:
            return None
        producers = self.producers
        got = producers.counts() if producers is not None else {}
        counts: dict[str, float] = {
            "blocks_received": got.get("blocks_received", 0),
            "bytes_received": got.get("bytes_received", 0),
            "blocks_rejected": got.get("rejected", 0),
            "asks": got.get("asks", 0),
            "failed_asks": got.get("failures", 0),
            "seconds": got.get("seconds", 0.0),
        }
        if self.server is not None:
            counts["blocks_served"] = self.server.blocks_served
            counts["bytes_served"] = self.server.bytes_served
            counts.update(self.connector.store.hold_counts())
        return counts

    def transfer_metadata(self) -> dict[str, Any] | None:
        """What a router's event mirror needs to predict a consumer's hit (the producers'
        tiers it reads, kvserve.events.index): where this engine serves, whom it reads."""
        t = self.transfer
        if t is None:
            return None
        serves = t.endpoint if t.produces else None
        return {"kv_transfer": {"serves": serves, "reads": list(t.peers) if t.consumes else []}}

    def stats(self) -> dict[str, Any]:
        c = self.connector.stats
        return {
            "offload_bytes_loaded": c.bytes_loaded,
            "offload_bytes_saved": self.connector.store.bytes_saved,
            "offload_load_seconds": c.load_seconds,
            "offload_save_seconds": c.save_seconds,
            "offload_dropped_writes": self.connector.store.dropped_writes,
        }


def _fast_matmul(runner: Any) -> str | None:
    """The fast mode's float matmul that changes a block's last bits, if any."""
    from kvserve.model.quant.onednn_linear import onednn_available
    from kvserve.model.quant.panel_linear import panels_available

    dtype, device, exact = runner.dtype, runner.device, runner.exact
    if panels_available(dtype, device, exact):  # kvserve's kernels on the weights' panels
        return "panels-" + str(dtype).removeprefix("torch.")
    if str(dtype) == "torch.float32" and onednn_available(dtype, device, exact):
        return "onednn-packed"
    return None


def _model_io(runner: Any, args: EngineArgs) -> tuple[Any, bytes]:
    """The model runner's K/V tensors as blocks, and the fingerprint keying the tiers."""
    from kvserve.model.memory.kv_io import KVBlockIO, kv_fingerprint

    if runner.model_dir is None:
        raise ValueError("offload needs a model checkpoint (its fingerprint keys the tiers)")
    fingerprint = kv_fingerprint(
        runner.model_dir,
        runner.dtype,
        runner.kv_cache_specs,
        args.block_size,
        args.hash_fn,
        args.hash_seed,
        runner.quantization,
        matmul=_fast_matmul(runner),
    )
    layout = runner.layer_groups
    return KVBlockIO(runner.kv_tensors, layout.layer_group, layout.layer_slot), fingerprint
