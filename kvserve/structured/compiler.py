"""A request's constraint -> a compiled grammar: checked now, compiled on a pool, with a deadline.

Building the xgrammar `Grammar` (parsing the schema, regex or EBNF) is quick
and runs on the caller's thread, so a constraint xgrammar cannot read is a
ValueError from `add_request`, naming the problem, before anything is queued.
Compiling it against the tokenizer (the per-token mask cache: the slow part,
seconds for a 30,000-value enum) runs on a pool of worker threads: xgrammar's
compiler is thread-safe and releases the GIL in its C++ work, so compiles run
side by side and a slow one holds one worker, not the others. A compile
cannot be interrupted, so each waiting request has its own deadline
(`timeout`, GrammarState fails it past that); a compile whose every waiting
request left (aborted, or past its deadline) is cancelled if it has not
started, and its result is dropped if it has. Compiles are kept in an LRU
keyed by the constraint, bounded by the compiled grammars' bytes (xgrammar's
`memory_size_bytes`), so a repeated schema compiles once per engine; xgrammar's
own unbounded cache is off.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import xgrammar as xgr

from kvserve.sampling_params import StructuredOutputsParams

WORKERS = 4
"""Compiles that run at once (each uses up to two of xgrammar's own threads)."""
CACHE_MB = 256
"""Compiled grammars an engine keeps, in MiB (least recently used dropped first)."""
COMPILE_TIMEOUT = 30.0
"""Seconds a request waits for its grammar's compile before it fails."""
DEAD_END = "structured_outputs: the grammar accepts no output (no token can start it)"

_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


@dataclass(slots=True, eq=False)
class Pending:
    """One constraint's compile, shared by every sequence that waits for it."""

    key: tuple[str, str]
    future: Future[xgr.CompiledGrammar]
    waiters: int = 0
    size: int = 0
    """The compiled grammar's bytes, once it is done and cached."""
    cached: bool = True
    owner: GrammarCompiler | None = field(default=None, repr=False)

    def join(self) -> None:
        """One more sequence waits for it."""
        if self.owner is not None:
            self.owner.join(self)
        else:
            self.waiters += 1

    def leave(self) -> None:
        """A sequence no longer waits (it has its matcher, failed, or was aborted)."""
        if self.owner is not None:
            self.owner.leave(self)
        else:
            self.waiters -= 1


class GrammarCompiler:
    """One engine's grammars: its tokenizer's xgrammar compiler, the workers, the cache."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: set[int],
        max_threads: int = 2,
        workers: int = WORKERS,
        cache_bytes: int = CACHE_MB << 20,
    ) -> None:
        """`vocab_size`: the logits' width (padded embeddings included: the mask covers
        them); `stop_token_ids`: the model's EOS ids, the only tokens a finished
        grammar allows."""
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_ids = sorted(stop_token_ids)
        self._max_threads = max_threads
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._lock = threading.RLock()
        """Guards the cache: the engine thread submits and leaves, workers finish."""
        self._cache: OrderedDict[tuple[str, str], Pending] = OrderedDict()
        self.cache_bytes = cache_bytes
        self.cached_bytes = 0
        """Bytes of the compiled grammars the cache holds now."""
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvserve-grammar")

    def submit(self, spec: StructuredOutputsParams) -> Pending:
        """The compile of `spec` (started, or found in the cache); ValueError if it cannot
        be read. Each sequence that waits for it `join`s it, and `leave`s it when done."""
        key = spec.key
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                return found
        grammar = build_grammar(*key)
        pending = Pending(key, self._pool.submit(self._compile, grammar), owner=self)
        with self._lock:
            self._cache[key] = pending
        pending.future.add_done_callback(lambda _: self._done(pending))
        return pending

    def join(self, pending: Pending) -> None:
        with self._lock:
            pending.waiters += 1

    def leave(self, pending: Pending) -> None:
        """A waiter is gone: the last one of an unfinished compile cancels it (not started)
        or drops it from the cache (running: its result is thrown away)."""
        with self._lock:
            pending.waiters -= 1
            if pending.waiters > 0 or pending.future.done():
                return
            pending.future.cancel()
            self._drop(pending)

    def cached(self) -> int:
        """Constraints the cache holds (done or compiling)."""
        with self._lock:
            return len(self._cache)

    def _done(self, pending: Pending) -> None:
        """A compile ended (a worker's thread): count its bytes, evict past the bound."""
        with self._lock:
            if not pending.cached:
                return
            if pending.future.cancelled() or pending.future.exception() is not None:
                self._drop(pending)  # a failed compile is tried again by the next request
                return
            pending.size = pending.future.result().memory_size_bytes
            self.cached_bytes += pending.size
            for key in list(self._cache):
                if self.cached_bytes <= self.cache_bytes:
                    break
                old = self._cache[key]
                if old.future.done():
                    self._drop(old)

    def _drop(self, pending: Pending) -> None:
        if pending.cached and self._cache.get(pending.key) is pending:
            del self._cache[pending.key]
            self.cached_bytes -= pending.size
        pending.cached = False

    def _compile(self, grammar: xgr.Grammar) -> xgr.CompiledGrammar:
        compiled = self.compiler.compile_grammar(grammar)
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, self._vocab_size)
        matcher.fill_next_token_bitmask(bitmask, 0)
        if not bool(bitmask.any()):  # e.g. {"anyOf": []}: no alternative at all
            raise ValueError(DEAD_END)
        return compiled

    @property
    def compiler(self) -> xgr.GrammarCompiler:
        """xgrammar's compiler for this tokenizer, built on first use (reading a large
        vocabulary takes a while: a worker pays it, not the engine thread)."""
        with self._compiler_lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_ids
                )
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=self._max_threads, cache_enabled=False
                )
            return self._compiler

    def close(self) -> None:
        """Stop the workers (a compile under way finishes on its own)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            self._cache.clear()
            self.cached_bytes = 0


def build_grammar(kind: str, text: str) -> xgr.Grammar:
    """The xgrammar Grammar of one constraint (StructuredOutputsParams.key); ValueError
    naming the field and xgrammar's reason when it cannot be built."""
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(_schema_text(text), any_whitespace=False)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(text)))
        if kind == "structural_tag":
            return xgr.Grammar.from_structural_tag(text)
        return xgr.Grammar.from_ebnf(text)
    except ValueError:
        raise
    except Exception as exc:  # xgrammar raises RuntimeError with its C++ log prefix
        reason = _LOG_PREFIX.sub("", str(exc).strip()).splitlines()[0][:300]
        raise ValueError(f"structured_outputs.{kind}: {reason}") from None


def _schema_text(text: str) -> str:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
    if not isinstance(schema, dict | bool):
        raise ValueError("structured_outputs.json must be a JSON schema (an object)")
    return text


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices` (each a quoted literal)."""
    literals = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices if c)
    if "" in choices:
        literals = f'({literals}) | ""' if literals else '""'
    return f"root ::= {literals}"
