"""A runner without a model, for `simulate`: prefill is free, decode is a rolling hash.

Each sampled token is a function of the request's whole token sequence so far
(kept as a rolling state, so a step costs O(1)), the way greedy decoding
behaves: identical prompts continue identically, so generated blocks are
cacheable, and a later turn's prompt may contain an earlier answer.
"""

from __future__ import annotations

from kvserve.engine.scheduler import SchedulerOutput

_MASK = (1 << 64) - 1
_MULT = 0x100000001B3


def _mix(state: int, token: int) -> int:
    return ((state ^ token) * _MULT) & _MASK


class ModelFreeRunner:
    def __init__(self, vocab_size: int = 32000) -> None:
        self.vocab_size = vocab_size
        self._state: dict[str, tuple[int, int]] = {}
        """request id -> (tokens folded in, rolling state)."""

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        """The next token of every chunk that reaches its sequence's end."""
        sampled = {}
        for chunk in out.chunks:
            if not chunk.samples:
                continue
            req = chunk.request
            tokens = req.token_ids
            folded, state = self._state.get(req.request_id, (0, 0xCBF29CE484222325))
            for token in tokens[folded:]:
                state = _mix(state, token)
            self._state[req.request_id] = (len(tokens), state)
            sampled[req.request_id] = (state >> 17) % self.vocab_size
        return sampled

    def free_request(self, request_id: str) -> None:
        self._state.pop(request_id, None)
