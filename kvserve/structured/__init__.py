"""Constrained decoding: a request's `structured_outputs` as a grammar (xgrammar).

`compiler.py` turns a constraint into a compiled grammar (checked on the caller's
thread, compiled on a worker thread, cached per engine); `state.py` is one
sequence's matcher. The runner reads a state to mask a row's logits
(kvserve.model.sampling.grammar_mask); the stop checker advances it with each
accepted token (kvserve.engine.stop).

Nothing of xgrammar is imported before the first constrained request: a plain engine never
loads it. Files:

- compiler.py: a constraint checked on the caller's thread (ValueError naming it);
  compiled on a pool of worker threads (xgrammar releases the GIL), each waiting sequence
  with its own deadline, a compile nobody waits for cancelled or its result dropped; a
  grammar that accepts nothing fails its compile; an LRU per engine bounded by the
  compiled grammars' bytes.
- state.py: one sequence's matcher; a row whose grammar allows no token fails before it
  is sampled.
- tags.py: structural tags as plain data, no xgrammar import: free text until a trigger
  then a tag, tags with a separator, sequences: one constraint, `structural_tag`, that
  composes grammars; `as_format`: any constraint as a part of one; tool calls use it, and
  so can a reasoning block before a schema.
- after_text.py: "free text without a marker, the marker, then this constraint" as one
  EBNF grammar: a reasoning model's thinking, then its schema; the engine runs it as any
  grammar.

Who owns a grammar state (`GrammarState`, state.py, on the sequence's `Request`): a
constrained sequence's own xgrammar matcher (each of `n` completions has one) over its
request's compiled grammar. Its state is the sequence's accepted output tokens and
nothing else. `add_request` makes it (the constraint checked there; the compile queued on
the grammar workers, cached per engine by the constraint); the scheduler admits the
sequence only once the compile is done or its deadline (`grammar_compile_timeout`) passed
(others go on; a step with nothing else to run waits up to 50 ms for a compile); an abort
leaves the compile (the last waiter to leave cancels it); the runner *reads* it (fills
the row of the step's bitmask, applied before penalties, bias, temperature and the
filters; rows without one pay an attribute check); the stop checker *advances* it, once
per appended token, on the engine thread, and a grammar that accepted its end (the
model's EOS) stops the sequence (`stop`, the EOS text left out). Preemption recomputes K/V
but keeps the output tokens, so the matcher needs no rollback; chunked prefill, prefix
hits and tier loads never reach it (only a sampled row is masked): each is tested against
the plain constrained run (tests/engine/test_structured_scheduling.py). A compile that
fails after the check fails its request alone (its row's sampling raises).

Tool calls add no state of their own to the engine: their grammar is one structural tag
(tags.py, built by kvserve/tool_calls/request.py in the parser's own format), compiled and
advanced as any constraint; for `tool_choice: auto` the matcher accepts free text until
the trigger, then holds the call. The server reads the calls back from the text
(kvserve.tool_calls: the parser per choice, streamed by `ToolCallStream`, owned by the
response's Job).
"""
