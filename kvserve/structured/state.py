"""One sequence's grammar state: its own xgrammar matcher over a compiled grammar.

The matcher's state is the sequence's accepted output tokens, and nothing
else: each of a request's `n` completions has its own. Only the stop checker
advances it (kvserve.engine.stop, once per appended token, on the engine
thread); the runner only reads it to fill the row's token bitmask. A preempted
sequence keeps its output tokens (it recomputes their K/V, it does not redo
them), so its matcher stays as it is; a sequence never loses a token it
accepted, so no rollback is needed.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import xgrammar as xgr


class GrammarState:
    """A sequence's matcher, made when its grammar's compile is done."""

    __slots__ = ("_matcher", "future")

    def __init__(self, future: Future[xgr.CompiledGrammar]) -> None:
        self.future = future
        self._matcher: xgr.GrammarMatcher | None = None

    @property
    def ready(self) -> bool:
        """True once the compile ended (the scheduler admits the sequence only then)."""
        return self.future.done()

    @property
    def matcher(self) -> xgr.GrammarMatcher:
        """The matcher. A compile that failed raises here, a ValueError whose message
        starts `structured_outputs:` (the server answers it as a 400): the sequence
        fails alone."""
        if self._matcher is None:
            try:
                compiled = self.future.result()
            except Exception as exc:
                reason = str(exc).strip().splitlines()[-1:] or [type(exc).__name__]
                raise ValueError(
                    f"structured_outputs: the grammar failed to compile: {reason[0][:300]}"
                ) from None
            self._matcher = xgr.GrammarMatcher(compiled)
        return self._matcher

    def fill(self, bitmask: Any, row: int) -> None:
        """Row `row` of the int32 `bitmask` [rows, ceil(vocab / 32)]: the tokens allowed next."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> None:
        """Advance past `token`; ValueError if the grammar does not allow it."""
        if not self.matcher.accept_token(token):
            raise ValueError(f"token {token} is not allowed by the request's grammar")

    @property
    def terminated(self) -> bool:
        """True once the grammar accepted its end (a stop token): the sequence stops."""
        return self.matcher.is_terminated()
