"""Constrained decoding: a request's `structured_outputs` as a grammar (xgrammar).

`compiler.py` turns a constraint into a compiled grammar (checked on the caller's
thread, compiled on a worker thread, cached per engine); `state.py` is one
sequence's matcher. The runner reads a state to mask a row's logits
(kvserve.model.sampling.grammar_mask); the stop checker advances it with each
accepted token (kvserve.engine.stop). docs/design.md says who owns what.
"""
