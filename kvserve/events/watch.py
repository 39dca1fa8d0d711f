"""`kvserve events --connect ...`: print an engine's KV events and the index it builds."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvserve.events.subscriber import KVEventSubscriber, ReplayUnavailable
from kvserve.kvcache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    WireHash,
)


def _short(h: WireHash) -> str:
    return f"{h:016x}" if isinstance(h, int) else bytes(h).hex()[:16]


def describe(seq: int, batch: KVEventBatch) -> list[str]:
    """One line per event, prefixed by the batch's seq."""
    lines = []
    for e in batch.events:
        if isinstance(e, BlockStored):
            parent = "-" if e.parent_block_hash is None else _short(e.parent_block_hash)
            hashes = " ".join(_short(h) for h in e.block_hashes[:4])
            more = f" (+{len(e.block_hashes) - 4})" if len(e.block_hashes) > 4 else ""
            lines.append(
                f"[{seq}] stored  group {e.group_idx} ({e.kv_cache_spec_kind}) "
                f"{len(e.block_hashes)} x {e.block_size} tokens, parent {parent}: {hashes}{more}"
            )
        elif isinstance(e, BlockRemoved):
            hashes = " ".join(_short(h) for h in e.block_hashes)
            lines.append(f"[{seq}] removed group {e.group_idx}: {hashes}")
        elif isinstance(e, AllBlocksCleared):
            lines.append(f"[{seq}] all blocks cleared")
    return lines


def watch(
    connect: str,
    replay: str | None,
    topic: str = "",
    duration: float | None = None,
    quiet: bool = False,
    out: Callable[[str], None] = print,
) -> KVEventSubscriber | None:
    """Follow one engine until `duration` seconds pass (None: until interrupted).

    Until an engine answers on `replay` it waits, saying so once; when `duration`
    passes first, ReplayUnavailable says that no engine answered. Interrupted while
    waiting: None.
    """
    start = time.monotonic()

    def on_batch(seq: int, batch: KVEventBatch) -> None:
        if not quiet:
            for line in describe(seq, batch):
                out(line)
        view = sub.view if sub is not None else None
        if view is not None:
            out(f"[{seq}] index: {view.num_blocks} blocks for {connect}")

    def time_left() -> bool:
        return duration is None or time.monotonic() - start < duration

    sub: KVEventSubscriber | None = None
    waiting = False
    try:
        while sub is None:
            try:
                sub = KVEventSubscriber(
                    connect, replay, topic=topic, on_batch=on_batch, request_timeout=1.0
                )
            except ReplayUnavailable:
                if not time_left():
                    raise ReplayUnavailable(
                        f"no engine answered at {replay} (the replay endpoint of {connect}) "
                        f"within {duration:g} s"
                    ) from None
                if not waiting:
                    out(f"waiting for an engine at {connect} (no answer at {replay} yet) ...")
                    waiting = True
    except KeyboardInterrupt:
        return None
    out(f"following {connect}: index {sub.view.num_blocks} blocks, after batch {sub.last_seq}")
    try:
        while time_left():
            try:
                sub.poll(0.2)
            except ReplayUnavailable as exc:  # the engine went away in the middle of a gap
                out(f"{exc}: the next batch retries")
    except KeyboardInterrupt:
        pass
    finally:
        sub.close()
    out(
        f"index: {sub.view.num_blocks} blocks; last batch {sub.last_seq}; gaps {sub.gaps}, "
        f"replays {sub.replays}, resyncs {sub.resyncs}"
    )
    return sub
