"""Per-request sampling parameters, as vLLM spells them.

Pure Python (no torch): the scheduler, the CLI and the server validate
requests with this class before anything reaches the model.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, replace
from typing import Any


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
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's names); exactly one field is set.

    `json`: a JSON schema (a dict or its text); `json_object`: any JSON object;
    `regex`: the whole output matches it; `choice`: the output is one of these
    strings; `grammar`: an EBNF grammar (GBNF, as xgrammar reads it) with a `root`
    rule; `structural_tag`: an xgrammar structural tag (a dict or its JSON text:
    free text, tags, triggers, schemas composed; kvserve.structured.tags builds
    them, tool calls use it). Only the shape is checked here (pure Python); whether the grammar
    backend can compile it is checked when the request is added (ValueError).
    """

    json: str | dict[str, Any] | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        set_ = [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, json_object, regex, choice, "
                f"grammar, structural_tag; got {set_ or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, str | dict):
            raise ValueError(
                f"structured_outputs.json must be a dict or a string, got {_short(self.json)}"
            )
        tag = self.structural_tag
        if tag is not None and (not isinstance(tag, str | dict) or not tag):
            raise ValueError("structured_outputs.structural_tag must be a dict or a string")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be True or False")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if (
                not isinstance(self.choice, list | tuple)
                or not self.choice
                or not all(isinstance(c, str) for c in self.choice)
            ):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            self.choice = list(self.choice)

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): what a compiled grammar is cached under."""
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else json.dumps(self.json)
            return "json", text
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        if self.structural_tag is not None:
            tag = self.structural_tag
            return "structural_tag", tag if isinstance(tag, str) else json.dumps(tag)
        return "grammar", self.grammar or ""


CONSTRAINTS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(slots=True)
class SamplingParams:
    """How to pick the next token and when to stop.

    `temperature=0` is greedy, and so is any temperature below `MIN_TEMPERATURE`
    (vLLM's rule: dividing logits by 1e-38 gives infinities, not a distribution).
    `top_k` of -1 or 0 and `top_p=1` / `min_p=0` disable those filters; a top_k
    above the vocabulary keeps it all. Every integer fits a signed 64-bit integer
    (a seed as vLLM takes it: [-2**63, 2**63 - 1]). A `seed` makes a request's samples reproducible
    whatever else runs in the same batch. Invalid values raise ValueError
    naming the field, so a bad request fails alone (design.md invariant 11).

    The output text follows vLLM: the text of a stop token (EOS or a
    `stop_token_ids` hit; the token stays in `token_ids`) and a matched stop
    string are left out unless `include_stop_str_in_output`;
    `skip_special_tokens` drops special tokens' text.

    Logit adjustments (OpenAI / vLLM semantics) apply before temperature and the
    filters, to greedy requests too, in vLLM's order: `logit_bias` (token id ->
    value added; digit-string keys, as JSON gives them, become ints), then
    `repetition_penalty` over the prompt and the generated tokens (a seen
    token's positive logit is divided by it, a negative one multiplied), then
    `presence_penalty` and `frequency_penalty` over the generated tokens
    (logit -= presence * (count > 0) + frequency * count). `structured_outputs`
    constrains the output (kvserve.structured): its token mask applies before
    all of these; a finished grammar ends the sequence ("stop"). `logprobs` asks for
    the sampled token's log-probability plus those of the `logprobs` most
    likely tokens at every generated position, from the model's raw
    distribution (before any adjustment, temperature or filter).
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
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._validate()
        if self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0

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
            _check_int("seed", self.seed, minimum=INT64_MIN)
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if self.stop is not None:
            if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
                raise ValueError(
                    f"stop must be a string or a list of strings, got {_short(self.stop)}"
                )
            if any(s == "" for s in self.stop):
                raise ValueError("stop must not contain empty strings")
        if self.stop_token_ids is not None:
            ids = self.stop_token_ids
            if not isinstance(ids, list | tuple) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT64_MAX for t in ids
            ):
                raise ValueError(
                    f"stop_token_ids must be a list of non-negative integers, got {_short(ids)}"
                )
            self.stop_token_ids = list(ids)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        _check_bool("ignore_eos", self.ignore_eos)
        _check_bool("skip_special_tokens", self.skip_special_tokens)
        _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0)
            if self.logprobs > MAX_LOGPROBS:
                raise ValueError(f"logprobs must be <= {MAX_LOGPROBS}, got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.logit_bias is not None:
            self.logit_bias = _checked_bias(self.logit_bias)
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(
                f"structured_outputs must be StructuredOutputsParams, got {type(so).__name__}"
            )

    @property
    def greedy(self) -> bool:
        """Temperature 0 picks the most likely token; the other filters are moot."""
        return self.temperature == 0

    @property
    def adjusts_logits(self) -> bool:
        """True when a penalty or a logit bias changes the logits before sampling."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )

    def per_completion(self) -> list[SamplingParams]:
        """One params per completion (`n` = 1 each): each samples on its own, and a seed
        stays reproducible per index (the request's plus the index, kept signed 64-bit)."""
        if self.n == 1:
            return [self]
        seeds = [None if self.seed is None else (self.seed + i + 2**63) % 2**64 - 2**63
                 for i in range(self.n)]  # fmt: skip
        return [replace(self, n=1, seed=seed) for seed in seeds]


MIN_TEMPERATURE = 1e-5
"""Temperatures below this are greedy (vLLM's _SAMPLING_EPS)."""
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

MAX_LOGPROBS = 20
"""The most top log-probabilities a request may ask for per token (OpenAI's limit)."""

MAX_LOGIT_BIAS = 100.0


def _checked_bias(bias: object) -> dict[int, float]:
    """`logit_bias` with int keys (OpenAI's JSON gives digit strings) and checked values."""
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {_short(bias)}")
    checked: dict[int, float] = {}
    for key, value in bias.items():
        token = key
        if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 19:
            token = int(key)
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token <= INT64_MAX:
            raise ValueError(f"logit_bias keys must be non-negative token ids, got {_short(key)}")
        _check_number(f"logit_bias[{token}]", value)
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise ValueError(
                f"logit_bias[{token}] must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                f"got {value}"
            )
        checked[token] = float(value)
    return checked


def _check_int(name: str, value: object, minimum: int = INT64_MIN) -> None:
    """An int (not a bool) in [minimum, 2**63 - 1]; the message never echoes a huge value."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {_short(value)}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {_short(value)}")
    if value > INT64_MAX:
        raise ValueError(f"{name} must be <= {INT64_MAX} (2**63 - 1), got {_short(value)}")


def _short(value: object) -> str:
    """A value as an error message shows it: at most 40 characters."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {_short(value)}")


def _check_number(name: str, value: object) -> None:
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or (isinstance(value, float) and not math.isfinite(value))
    ):
        raise ValueError(f"{name} must be a finite number, got {_short(value)}")
