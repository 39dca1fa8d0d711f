"""A request's constraint -> a compiled grammar: checked now, compiled off the engine thread.

Building the xgrammar `Grammar` (parsing the schema, regex or EBNF) is quick
and runs on the caller's thread, so a constraint xgrammar cannot read is a
ValueError from `add_request`, naming the problem, before anything is queued.
Compiling it against the tokenizer (the per-token mask cache: the slow part)
runs on one worker thread; the request waits in the queue until its future is
done while the others go on (kvserve.engine.scheduler). Futures are kept in an
LRU keyed by the constraint, so a repeated schema compiles once per engine
(one engine: one tokenizer).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xgrammar as xgr

from kvserve.sampling_params import StructuredOutputsParams

CACHE_SIZE = 256
"""Compiled grammars an engine keeps (least recently used dropped first)."""

_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class GrammarCompiler:
    """One engine's grammars: its tokenizer's xgrammar compiler, a worker, the cache."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: set[int], max_threads: int = 2
    ) -> None:
        """`vocab_size`: the logits' width (padded embeddings included: the mask covers
        them); `stop_token_ids`: the model's EOS ids, the only tokens a finished
        grammar allows."""
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_ids = sorted(stop_token_ids)
        self._max_threads = max_threads
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future[xgr.CompiledGrammar]] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-grammar")

    def submit(self, spec: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar of `spec`, as a future; ValueError if it cannot be read."""
        key = spec.key
        future = self._cache.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(key)
            return future
        grammar = build_grammar(*key)
        future = self._pool.submit(self._compile, grammar)
        self._cache[key] = future
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return future

    def _compile(self, grammar: xgr.Grammar) -> xgr.CompiledGrammar:
        return self.compiler.compile_grammar(grammar)

    @property
    def compiler(self) -> xgr.GrammarCompiler:
        """xgrammar's compiler for this tokenizer, built on first use (reading a large
        vocabulary takes a while: the worker pays it, not the engine thread)."""
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_ids
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=self._max_threads)
            return self._compiler

    def close(self) -> None:
        """Stop the worker (a compile under way finishes on its own)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._cache.clear()


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
