"""One sequence's grammar state: its own xgrammar matcher over a compiled grammar.

The matcher's state is the sequence's accepted output tokens, and nothing
else: each of a request's `n` completions has its own. Only the stop checker
advances it (kvserve.engine.stop, once per appended token, on the engine
thread); the runner only reads it to fill the row's token bitmask. A preempted
sequence keeps its output tokens (it recomputes their K/V, it does not redo
them), so its matcher stays as it is; a sequence never loses a token it
accepted, so no rollback is needed.

A sequence waits for its compile (kvserve.structured.compiler) until its own
deadline; past it, or once its compile failed, it is "ready" and fails alone when
the scheduler would admit it (`failure`), before it takes a KV block or a step.
It leaves the compile once it has its matcher, fails, or is aborted, so a
compile nobody waits for any more is cancelled.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import xgrammar as xgr

from kvserve.structured.compiler import COMPILE_TIMEOUT

if TYPE_CHECKING:
    from kvserve.structured.compiler import Pending

_PREFIX = "structured_outputs"


class GrammarState:
    """A sequence's matcher, made when its grammar's compile is done."""

    __slots__ = ("_deadline", "_joined", "_matcher", "_pending", "_timeout")

    def __init__(self, pending: Pending, timeout: float = COMPILE_TIMEOUT) -> None:
        self._pending = pending
        self._timeout = timeout
        self._deadline = time.monotonic() + timeout
        self._matcher: xgr.GrammarMatcher | None = None
        pending.join()
        self._joined = True

    @property
    def future(self) -> Any:
        """The compile's future (the engine waits on it when nothing else can run)."""
        return self._pending.future

    @property
    def ready(self) -> bool:
        """True once the compile ended or this sequence's deadline passed (the scheduler
        admits the sequence only then)."""
        return self._pending.future.done() or time.monotonic() >= self._deadline

    @property
    def failure(self) -> str | None:
        """Why this sequence can never run, once it is `ready`: its compile failed or its
        deadline passed (`ValueError: structured_outputs: ...`, as a failed row reports
        it); None while it compiles or once it compiled. The scheduler reads it before it
        admits the sequence, so a grammar that cannot give a token costs no KV block and
        no prefill."""
        if self._matcher is not None or not self.ready:
            return None
        try:
            self.matcher  # noqa: B018 (made now if the compile succeeded: it is needed next)
        except ValueError as exc:
            return f"ValueError: {exc}"[:500]
        return None

    def release(self) -> None:
        """This sequence no longer waits for the compile (done, failed or aborted)."""
        if self._joined:
            self._joined = False
            self._pending.leave()

    @property
    def matcher(self) -> xgr.GrammarMatcher:
        """The matcher. A compile that failed, or did not end by the deadline, raises
        here, a ValueError whose message starts `structured_outputs:` (the server answers
        it as a 400): the sequence fails alone."""
        if self._matcher is None:
            future = self._pending.future
            if not future.done():
                self.release()
                raise ValueError(
                    f"{_PREFIX}: the grammar did not compile within {self._timeout:g}s "
                    "(--grammar-compile-timeout); a smaller schema, enum or tool list "
                    "compiles faster"
                )
            try:
                compiled = future.result()
            except ValueError as exc:
                self.release()
                if str(exc).startswith(_PREFIX):
                    raise
                raise self._failed(exc) from None
            except Exception as exc:
                self.release()
                raise self._failed(exc) from None
            self._matcher = xgr.GrammarMatcher(compiled)
            self.release()
        return self._matcher

    @staticmethod
    def _failed(exc: BaseException) -> ValueError:
        reason = str(exc).strip().splitlines()[-1:] or [type(exc).__name__]
        return ValueError(f"{_PREFIX}: the grammar failed to compile: {reason[0][:300]}")

    def fill(self, bitmask: Any, row: int) -> None:
        """Row `row` of the int32 `bitmask` [rows, ceil(vocab / 32)]: the tokens allowed
        next; ValueError when it allows none (nothing can be sampled)."""
        matcher = self.matcher
        matcher.fill_next_token_bitmask(bitmask, row)
        if not bool(bitmask[row].any()):
            raise ValueError(
                f"{_PREFIX}: the grammar allows no next token (a dead end: a rule with no "
                "finite value, such as a schema that refers to itself)"
            )

    def accept(self, token: int) -> None:
        """Advance past `token`; ValueError if the grammar does not allow it."""
        if not self.matcher.accept_token(token):
            raise ValueError(f"token {token} is not allowed by the request's grammar")

    @property
    def terminated(self) -> bool:
        """True once the grammar accepted its end (a stop token): the sequence stops."""
        return self.matcher.is_terminated()
