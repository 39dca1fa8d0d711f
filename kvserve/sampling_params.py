"""Per-request sampling parameters, as vLLM spells them.

Pure Python (no torch): the scheduler, the CLI and the server validate
requests with this class before anything reaches the model.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class RequestOutputKind(enum.Enum):
    """Which outputs `LLMEngine.step` returns for a request (vLLM's names).

    CUMULATIVE: after every step that advanced it, everything so far.
    DELTA: after every step that advanced it, only what is new since its last
    output (what a streaming server sends; the pieces concatenate to the final
    text and token ids exactly).
    FINAL_ONLY: once, when it finishes (`LLM.generate` and `simulate`: building
    an output every step costs more than the step itself on a small model).
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(slots=True)
class SamplingParams:
    """How to pick the next token and when to stop.

    `temperature=0` is greedy. `top_k` of -1 or 0 and `top_p=1` / `min_p=0`
    disable those filters. A `seed` makes a request's samples reproducible
    whatever else runs in the same batch. Invalid values raise ValueError
    naming the field, so a bad request fails alone (design.md invariant 11).

    The output text follows vLLM: the text of a stop token (EOS or a
    `stop_token_ids` hit; the token stays in `token_ids`) and a matched stop
    string are left out unless `include_stop_str_in_output`;
    `skip_special_tokens` drops special tokens' text.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._validate()

    def _validate(self) -> None:
        _check_int("n", self.n, minimum=1)
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k}")
        _check_number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed)
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if self.stop is not None:
            if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
                raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
            if any(s == "" for s in self.stop):
                raise ValueError("stop must not contain empty strings")
        if self.stop_token_ids is not None:
            ids = self.stop_token_ids
            if not isinstance(ids, list | tuple) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
            ):
                raise ValueError(
                    f"stop_token_ids must be a list of non-negative integers, got {ids!r}"
                )
            self.stop_token_ids = list(ids)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        _check_bool("skip_special_tokens", self.skip_special_tokens)
        _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)

    @property
    def greedy(self) -> bool:
        """Temperature 0 picks the most likely token; the other filters are moot."""
        return self.temperature == 0


def _check_int(name: str, value: object, minimum: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def _check_number(name: str, value: object) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")
