"""What the layers of one step read, built once per step: one metadata per KV cache
group, handed to each layer by its group.

An attention group gets the attention backend's metadata
(kvserve.model.attention.attention_metadata for "plain", kvserve.model.attention.flex_metadata
for "flex", kvserve.model.attention.paged_metadata for "triton"), a Mamba state group a
StateMetadata (kvserve.model.layers.mamba2). Both come from the chunks' plans only.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Any

import torch

from kvserve.batch import SeqChunk
from kvserve.kvcache.specs import KVCacheSpec, MambaStateSpec
from kvserve.model.attention.attention_metadata import AttentionMetadata


def _flex_build(*args: Any) -> Any:
    from kvserve.model.attention.flex_metadata import FlexMetadata  # torch's flex module on demand

    return FlexMetadata.build(*args)


def _triton_build(*args: Any) -> Any:
    from kvserve.model.attention.paged_metadata import PagedMetadata

    return PagedMetadata.build(*args)


METADATA_BUILDERS: dict[str, Callable[..., Any]] = {
    "plain": AttentionMetadata.build,
    "flex": _flex_build,
    "triton": _triton_build,
}
"""Per attention backend (EngineArgs.attention_backend), its metadata builder."""


def check_backend(name: str, device: torch.device | None = None) -> str:
    """The backend's name if it exists and can run on `device` (checked once known)."""
    if name not in METADATA_BUILDERS:
        raise ValueError(
            f"attention_backend must be one of {', '.join(METADATA_BUILDERS)}, got {name!r}"
        )
    if name == "triton" and device is not None:
        if importlib.util.find_spec("triton") is None:
            raise ValueError(
                "attention_backend 'triton' needs the triton package (CUDA builds of torch "
                "install it; else pip install triton)"
            )
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"attention_backend 'triton' runs on CUDA, not on {device.type} (on the CPU "
                "only in Triton's slow interpreter, TRITON_INTERPRET=1, for tests)"
            )
    return name


def step_metadata(
    chunks: list[SeqChunk],
    specs: list[KVCacheSpec],
    block_size: int,
    device: torch.device,
    backend: str = "plain",
) -> list[Any]:
    """One metadata per KV cache group, in the order of `specs`."""
    build = METADATA_BUILDERS[backend]
    return [
        state_metadata(chunks, g)
        if isinstance(spec, MambaStateSpec)
        else build(
            [
                (c.plan.start, c.plan.num_tokens, c.plan.block_ids[g], c.plan.skip_write_until)
                for c in chunks
            ],
            block_size,
            device,
            getattr(spec, "sliding_window", None),
        )
        for g, spec in enumerate(specs)
    ]


def state_metadata(chunks: list[SeqChunk], group: int) -> Any:
    """Where each chunk's state comes from and goes, for one state group."""
    from kvserve.model.layers.mamba2 import StateMetadata, StateSegment

    segments = []
    row = 0
    for chunk in chunks:
        plans = chunk.plan.state_plans
        assert plans is not None  # the runner checked every chunk's state plans
        plan = plans[group]
        assert plan is not None
        num = chunk.plan.num_tokens
        segments.append(StateSegment(row, num, plan.state_in, plan.state_out, list(plan.snapshots)))
        row += num
    return StateMetadata(segments)
