"""Driving an engine to the end in the step API, as the tests of its outputs do."""

from __future__ import annotations

from kvserve.engine.llm_engine import LLMEngine


def run(engine: LLMEngine) -> dict[str, list]:
    """Every output of every request, in step order."""
    outputs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
    return outputs
