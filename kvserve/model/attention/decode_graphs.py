"""Decode steps replayed from CUDA graphs ("triton" attention backend on CUDA).

A decode step of a small model is hundreds of small kernel launches, and launching
them from Python takes longer than the GPU takes to run them. A CUDA graph records
a step's launches once and replays them with one call. A graph replays fixed tensor
addresses and shapes, so every input of the model's forward lives in a static buffer
here, and one graph is captured per batch bucket (1, 2, 4, 8, then multiples of 16 up
to max_num_seqs, at most MAX_BATCH), largest first, all sharing one memory pool.

A step of B decodes is copied into the buffers of the smallest bucket >= B (one copy to
the device) and that graph replays. The rows past B are padding: token 0 at position 0,
its K/V not stored (slot -1), reading the null block (zeros). The Triton kernels read
each sequence's context through its block-table row in place (kvserve.model.
triton_attention), so a table row only needs the blocks this step reaches; the entries
past them are never read. Only the model's forward is captured: logits and sampling run
on the B real rows, eagerly.

Graphs are used on CUDA with the "triton" backend and no Mamba state groups (their
metadata is per-chunk Python), for a model whose forward can be captured (not the
mixtures of experts: their dispatch reads each step's routing on the host), unless
`enforce_eager`. With `capture=False` the same
buffers and padding feed an eager forward: the CPU tests check this class that way.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from kvserve.batch import SeqChunk
from kvserve.model.attention.paged_metadata import PagedMetadata, pack

logger = logging.getLogger(__name__)

MAX_BATCH = 512
"""The largest bucket captured; larger decode steps run eagerly."""


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, 48, ... up to max_num_seqs (at most MAX_BATCH), which is
    itself the last bucket."""
    largest = max(1, min(max_num_seqs, MAX_BATCH))
    buckets = [b for b in (1, 2, 4, 8) if b < largest]
    buckets += list(range(16, largest, 16))
    return [*buckets, largest]


class DecodeGraphs:
    """The static inputs of decode steps and, on CUDA, one captured graph per bucket."""

    def __init__(self, runner: Any, max_num_seqs: int, capture: bool = True) -> None:
        if runner.state_groups:
            raise ValueError("decode graphs do not cover Mamba state groups")
        self.runner = runner
        self.buckets = batch_buckets(max_num_seqs)
        self.kv_caches = runner.kv_caches
        """The pool the graphs read and write: a step on another one (a scratch cache)
        runs eagerly."""
        self.width = -(-runner.max_model_len // runner.block_size)
        """Block-table entries a row can hold."""
        largest, device = self.buckets[-1], runner.device
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slots = [torch.full((largest,), -1, dtype=torch.long, device=device)
                      for _ in runner.kv_cache_specs]  # fmt: skip
        self.seq_starts = [torch.zeros(largest, dtype=torch.long, device=device)
                           for _ in runner.kv_cache_specs]  # fmt: skip
        self.tables = [torch.zeros(largest, self.width, dtype=torch.long, device=device)
                       for _ in runner.kv_cache_specs]  # fmt: skip
        self.query_start = torch.arange(largest + 1, dtype=torch.long, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if capture:
            self._capture_all()

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest bucket that holds `num_seqs` rows; None past the largest."""
        return next((b for b in self.buckets if b >= num_seqs), None)

    def forward(self, chunks: list[SeqChunk]) -> torch.Tensor | None:
        """The final hidden states [B, hidden] of a decode step, or None when the step is
        not one for a graph (a chunk of several tokens, too many rows, a context longer
        than a table row, or another pool than the captured one)."""
        if self.runner.kv_caches is not self.kv_caches:
            return None
        if any(chunk.plan.num_tokens != 1 for chunk in chunks):
            return None
        rows = len(chunks)
        bucket = self.bucket(rows)
        if bucket is None or any(c.plan.end > self.width * self.runner.block_size for c in chunks):
            return None
        self._fill(chunks, bucket)
        if bucket in self.graphs:
            graph, hidden = self.graphs[bucket]
            graph.replay()
            return hidden[:rows]
        return self._run(bucket)[:rows]

    def _fill(self, chunks: list[SeqChunk], bucket: int) -> None:
        """Copy the step's inputs into the static buffers, rows past the step padded: one
        copy to the device, then device copies into place."""
        padding = bucket - len(chunks)
        ids = [chunk.new_token_ids[0] for chunk in chunks] + [0] * padding
        positions = [chunk.plan.start for chunk in chunks] + [0] * padding
        parts = [torch.tensor(ids + positions, dtype=torch.long)]
        widths = []
        for g in range(len(self.runner.kv_cache_specs)):
            spans = [(c.plan.start, 1, c.plan.block_ids[g], c.plan.skip_write_until)
                     for c in chunks] + [(0, 1, (0,), 1)] * padding  # fmt: skip
            packed, _, width, _ = pack(spans, self.runner.block_size)
            parts.append(packed)
            widths.append(width)
        staged = torch.cat(parts).to(self.runner.device)
        self.input_ids[:bucket].copy_(staged[:bucket])
        self.positions[:bucket].copy_(staged[bucket : 2 * bucket])
        offset = 2 * bucket
        for g, (part, width) in enumerate(zip(parts[1:], widths, strict=True)):
            step = PagedMetadata.unpack(
                staged[offset : offset + len(part)], bucket, bucket, width, max_query_len=1
            )
            self.slots[g][:bucket].copy_(step.slots)
            self.seq_starts[g][:bucket].copy_(step.seq_starts)
            self.tables[g][:bucket, :width].copy_(step.block_tables)
            offset += len(part)

    def _metas(self, bucket: int) -> list[PagedMetadata]:
        """Per layer, its group's metadata over the first `bucket` rows of the buffers."""
        groups = [
            PagedMetadata(
                slots=self.slots[g][:bucket],
                query_start=self.query_start[: bucket + 1],
                seq_starts=self.seq_starts[g][:bucket],
                block_tables=self.tables[g][:bucket],
                max_query_len=1,
                window=getattr(spec, "sliding_window", None),
            )
            for g, spec in enumerate(self.runner.kv_cache_specs)
        ]
        return [groups[g] for g in self.runner.layer_groups.layer_group]

    def _run(self, bucket: int) -> torch.Tensor:
        return self.runner.model(
            self.input_ids[:bucket], self.positions[:bucket], self.kv_caches, self._metas(bucket)
        )

    def _capture_all(self) -> None:
        """One graph per bucket, largest first (the smaller ones reuse its memory). The
        buffers hold padding while capturing: nothing is stored, only the null block read."""
        t0 = time.perf_counter()
        pool = None
        with torch.inference_mode():
            for bucket in reversed(self.buckets):
                try:
                    self._run(bucket)  # compiles the kernels, settles lazy allocations
                    torch.cuda.synchronize(self.runner.device)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        hidden = self._run(bucket)
                except torch.cuda.OutOfMemoryError:
                    raise ValueError(  # the CLI prints it as one line, as a pool refusal
                        f"out of GPU memory capturing the CUDA graph of {bucket} decodes: "
                        "lower gpu_memory_utilization or max_num_seqs, or set enforce_eager"
                    ) from None
                pool = graph.pool()
                self.graphs[bucket] = (graph, hidden)
        torch.cuda.synchronize(self.runner.device)
        logger.info(
            "CUDA graphs: %d decode batch sizes (1 to %d) captured in %.2f s",
            len(self.buckets),
            self.buckets[-1],
            time.perf_counter() - t0,
        )
