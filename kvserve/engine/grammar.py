"""The engine's side of constrained decoding: a grammar state per sequence, and waiting.

A constrained request's constraint is checked and its compile queued when it
is added (kvserve.structured.compiler: ValueError there, before anything is
queued); each of its sequences gets its own state. Nothing of xgrammar is
imported until the first constrained request, so plain engines never load it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, wait
from typing import TYPE_CHECKING, Any

from kvserve.engine.request import Request
from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.engine.engine_args import EngineArgs
    from kvserve.structured.compiler import GrammarCompiler
    from kvserve.structured.state import GrammarState


class EngineGrammars:
    """One engine's compiled grammars (made on the first constrained request)."""

    def __init__(
        self,
        tokenizer: Any | None,
        vocab_size: int,
        eos_token_ids: set[int],
        args: EngineArgs | None = None,
    ) -> None:
        """`args`: grammar_compile_timeout (seconds a request waits for its compile) and
        grammar_cache_mb (the compiled grammars kept); None: the compiler's defaults."""
        self.compile_timeout = None if args is None else args.grammar_compile_timeout
        self.cache_mb = None if args is None else args.grammar_cache_mb
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.compiler: GrammarCompiler | None = None

    def states_for(self, params: SamplingParams) -> Callable[[], GrammarState] | None:
        """A maker of per-sequence grammar states for a constrained request, None for a
        plain one. ValueError when the constraint cannot be read."""
        spec = params.structured_outputs
        if spec is None:
            return None
        if self.compiler is None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs needs the checkpoint's tokenizer")
            from kvserve.structured import compiler

            mb = compiler.CACHE_MB if self.cache_mb is None else self.cache_mb
            self.compiler = compiler.GrammarCompiler(
                self.tokenizer, self.vocab_size, self.eos_token_ids, cache_bytes=mb << 20
            )
            if self.compile_timeout is None:
                self.compile_timeout = compiler.COMPILE_TIMEOUT
        from kvserve.structured.state import GrammarState

        timeout = self.compile_timeout
        assert timeout is not None
        pending = self.compiler.submit(spec)
        return lambda: GrammarState(pending, timeout)

    def release(self, sequences: Iterable[Request]) -> None:
        """The sequences no longer wait for their compiles (aborted, or never queued)."""
        for seq in sequences:
            if seq.grammar is not None:
                seq.grammar.release()

    def wait(self, waiting: Iterable[Request], timeout: float = 0.05) -> None:
        """Block until a waiting request's grammar compiled (at most `timeout` seconds):
        the engine calls this when a step found nothing else to run."""
        if self.compiler is None:
            return
        pending = [
            r.grammar.future for r in waiting if r.grammar is not None and not r.grammar.ready
        ]
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    def close(self) -> None:
        if self.compiler is not None:
            self.compiler.close()
