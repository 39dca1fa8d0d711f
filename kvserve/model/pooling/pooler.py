"""A step's pooling chunks -> their requests' embeddings, from the step's hidden states.

Only chunks that pool are read: a generation step pays one attribute check per
chunk. `last` needs only the hidden state of the prompt's last token, which the
chunk that ends the prompt computes. `mean` needs every prompt token's state:
each chunk's rows are kept here (per request, until the request finishes, so a
chunked or preempted prompt adds up), and averaged when the prompt is complete.
Embeddings are float32 and L2-normalized when the request asks (its `normalize`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.batch import SeqChunk, StepOutput


class Pooler:
    """The runner's pooling: per mean-pooled request, the prompt rows seen so far."""

    def __init__(self) -> None:
        self._rows: dict[str, torch.Tensor] = {}
        """request id -> [prompt tokens, hidden] float32; rows not computed yet are NaN."""

    def pool(
        self, hidden: torch.Tensor, chunks: Sequence[SeqChunk]
    ) -> tuple[dict[int, list[float]], dict[int, str]] | None:
        """Chunk index -> its embedding, for the pooling chunks that end their prompt, and
        chunk index -> why, for those that failed (each fails its request alone); None
        when no chunk pools (a generation step). `hidden`: the step's flattened rows."""
        if all(chunk.pooling is None for chunk in chunks):
            return None
        found: dict[int, list[float]] = {}
        failed: dict[int, str] = {}
        offset = 0
        for index, chunk in enumerate(chunks):
            n = chunk.plan.num_tokens
            params = chunk.pooling
            if params is not None:
                try:
                    vector = self._chunk(hidden[offset : offset + n], chunk, params.pooling)
                    if vector is not None:
                        if params.normalize:
                            vector = torch.nn.functional.normalize(vector, dim=-1)
                        found[index] = vector.tolist()
                except Exception as exc:
                    self.free_request(chunk.request_id)
                    failed[index] = f"{type(exc).__name__}: {exc}"[:500]
            offset += n
        return found, failed

    def _chunk(self, rows: torch.Tensor, chunk: SeqChunk, rule: str) -> torch.Tensor | None:
        ends = chunk.plan.end == len(chunk.token_ids)
        if rule == "last":
            return rows[-1].float() if ends else None
        plan = chunk.plan
        kept = self._rows.get(chunk.request_id)
        if kept is None:
            width = rows.shape[-1]
            kept = torch.full((len(chunk.token_ids), width), torch.nan, dtype=torch.float32)
            self._rows[chunk.request_id] = kept
        kept[plan.start : plan.end] = rows.float().cpu()
        if not ends:
            return None
        if torch.isnan(kept[:, 0]).any():
            raise ValueError(f"request {chunk.request_id}: mean pooling missed prompt tokens")
        del self._rows[chunk.request_id]
        return kept.mean(dim=0)

    def free_request(self, request_id: str) -> None:
        """Forget a finished or aborted request's rows."""
        self._rows.pop(request_id, None)


def attach_pooled(
    step: StepOutput, pooled: tuple[dict[int, list[float]], dict[int, str]] | None
) -> StepOutput:
    """The step's embeddings (and pooling failures) added to the runner's answer."""
    if pooled is not None:
        step.embeddings, failed = pooled
        if failed:
            step.errors = {**(step.errors or {}), **failed}
    return step
