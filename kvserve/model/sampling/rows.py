"""A step's sampling redone row by row, after the batched pass raised.

One request's bad parameters or logits must not fail the others of its step:
only then does the runner sample each row on its own, so a step without a
failure pays nothing for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvserve.batch import TokenLogprobs

log = logging.getLogger("kvserve.engine")

RowResult = tuple[list[int], list[TokenLogprobs | None] | None]


def each_row(
    num_rows: int, run_row: Callable[[int], RowResult]
) -> tuple[list[int | None], list[TokenLogprobs | None] | None, dict[int, str]]:
    """A step's sampling redone row by row after the batched pass failed: a row whose
    own work raises gets None and its error (row -> message); the others their tokens."""
    tokens: list[int | None] = []
    logprobs: list[TokenLogprobs | None] = []
    failed: dict[int, str] = {}
    for row in range(num_rows):
        token: int | None
        try:
            found, found_logprobs = run_row(row)
            token = found[0]
        except Exception as exc:
            log.exception("sampling row %d failed: only its request fails", row)
            failed[row] = f"{type(exc).__name__}: {exc}"[:500]
            token, found_logprobs = None, None
        tokens.append(token)
        logprobs.append(found_logprobs[0] if found_logprobs else None)
    return tokens, (logprobs if any(lp is not None for lp in logprobs) else None), failed
