"""Speculative decoding's settings as vLLM spells them, and each request's back-off.

`speculative_config` takes vLLM's keys (`method`, `num_speculative_tokens`,
`prompt_lookup_min`, `prompt_lookup_max`, `disable_by_batch_size`, and
`model` for a draft model) as a dict, its JSON text or a `SpeculativeConfig`.
Two methods are built: `"ngram"` (prompt lookup, kvserve.engine.ngram) and
`"draft_model"` (a smaller checkpoint sharing the target's tokenizer,
kvserve.model.draft_model); EAGLE, Medusa and MTP heads are refused by name.
The drafts are verified by the target model in one step
(kvserve.model.sampling.speculative), so greedy output is the output without
speculation, token for token.

Speculation costs a step more tokens; it pays only when drafts are accepted.
`SpecState` keeps, per request, an acceptance average and backs off (skips
drafting for a doubling number of steps) while it stays low, so random text
soon pays nothing but the prompt lookup.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import msgspec

METHODS = ("ngram", "draft_model")
REFUSED_METHODS = {
    "eagle": "EAGLE heads are not supported: use method 'ngram' or 'draft_model'",
    "eagle3": "EAGLE heads are not supported: use method 'ngram' or 'draft_model'",
    "medusa": "Medusa heads are not supported: use method 'ngram' or 'draft_model'",
    "mtp": "multi-token prediction heads are not supported: use method 'ngram' or 'draft_model'",
}
DEFAULT_DISABLE_BY_BATCH_SIZE = 4
"""kvserve's default: more running requests than this and no request drafts (on the
CPU a batch's decode rows already fill the matrix products; benchmarks/README.md)."""


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` keys that kvserve reads (others are refused by name)."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    """Draft tokens per step at most."""
    prompt_lookup_min: int = 1
    """Shortest suffix of the sequence looked up in its earlier tokens."""
    prompt_lookup_max: int = 4
    """Longest suffix looked up first (the longest match proposes)."""
    disable_by_batch_size: int | None = None
    """No drafts while more requests than this run (None: kvserve's default, 4)."""
    model: str | None = None
    """method "draft_model": the draft checkpoint (a path, as the target's is given)."""

    def __post_init__(self) -> None:
        if self.method in REFUSED_METHODS:
            raise ValueError(f"speculative_config: method {self.method!r}: "
                             f"{REFUSED_METHODS[self.method]}")  # fmt: skip
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config: method must be one of {', '.join(METHODS)}, "
                f"got {self.method!r}"
            )
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, "
                                 f"got {value!r}")  # fmt: skip
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                "speculative_config: prompt_lookup_min must be <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} > {self.prompt_lookup_max}"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config: method 'draft_model' needs 'model', the "
                             "draft checkpoint's path")  # fmt: skip
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(f"speculative_config: 'model' is read by method 'draft_model' "
                             f"only, not by {self.method!r}")  # fmt: skip
        limit = self.disable_by_batch_size
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
            raise ValueError(f"speculative_config: disable_by_batch_size must be an integer, "
                             f"got {limit!r}")  # fmt: skip

    @property
    def max_batch_size(self) -> int:
        """Most running requests at which drafts are still proposed."""
        limit = self.disable_by_batch_size
        return DEFAULT_DISABLE_BY_BATCH_SIZE if limit is None else limit

    @classmethod
    def from_any(cls, value: SpeculativeConfig | dict[str, Any] | str) -> SpeculativeConfig:
        """An object, a dict of vLLM's keys or its JSON text (msgspec reads the text and
        checks the types; a ValueError names an unknown key, a bad value or bad JSON)."""
        if isinstance(value, cls):
            return value
        try:
            raw = msgspec.json.decode(value) if isinstance(value, str | bytes) else value
        except msgspec.DecodeError as exc:
            raise ValueError(f"speculative_config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {raw!r:.40}")
        method = raw.get("method")
        if isinstance(method, str) and method in REFUSED_METHODS:  # before its other keys
            raise ValueError(f"speculative_config: method {method!r}: {REFUSED_METHODS[method]}")
        if "model" in raw and "method" not in raw:  # vLLM: a model alone is a draft model
            raw = {**raw, "method": "draft_model"}
        unknown = sorted(set(raw) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}")
        try:
            return msgspec.convert(raw, cls)
        except msgspec.ValidationError as exc:
            message = str(exc)  # __post_init__'s own messages name the config already
            prefix = "" if message.startswith("speculative_config") else "speculative_config: "
            raise ValueError(prefix + message) from None


EMA_WEIGHT = 0.5
"""Weight of the latest verification in a request's acceptance average."""
MIN_ACCEPTANCE = 0.3
"""Below this average a request stops drafting for a while: a verification row costs
about what a decode row does, so fewer accepted drafts than this do not pay."""
FIRST_PAUSE = 4
LONGEST_PAUSE = 256


@dataclass(slots=True)
class SpecState:
    """One request's speculation: its acceptance average and its back-off."""

    acceptance: float = 1.0
    """Average share of its drafts the target model accepted (optimistic at first)."""
    pause: int = 0
    """Steps left without drafts."""
    next_pause: int = FIRST_PAUSE
    """How long the next pause is (doubles while acceptance stays low)."""

    def drafting(self) -> bool:
        """Whether to draft this step (a paused request counts its pause down)."""
        if self.pause:
            self.pause -= 1
            return False
        return True

    def verified(self, num_drafts: int, num_accepted: int) -> None:
        """Fold in one verification; a low average starts a pause (doubled each time)."""
        rate = num_accepted / num_drafts
        self.acceptance = EMA_WEIGHT * rate + (1 - EMA_WEIGHT) * self.acceptance
        if self.acceptance < MIN_ACCEPTANCE:
            self.pause = self.next_pause
            self.next_pause = min(2 * self.next_pause, LONGEST_PAUSE)
            # After the pause one try: a miss pauses again (twice as long), a hit goes on.
            self.acceptance = MIN_ACCEPTANCE + 0.1
        elif rate >= 0.5:
            self.next_pause = FIRST_PAUSE


@dataclass(slots=True)
class SpecDecodeStats:
    """The engine's speculation counters (vLLM's spec_decode series in /metrics)."""

    num_drafts: int = 0
    """Verification rows: steps in which a request had drafts."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] | None = None
    """How often the draft at each position (0 first) was accepted."""

    def record(self, num_drafts: int, num_accepted: int, width: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if self.accepted_per_pos is None:
            self.accepted_per_pos = [0] * width
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted over drafted tokens (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
