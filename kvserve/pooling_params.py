"""How a pooling request turns its prompt's final hidden states into one vector.

vLLM's pooling runner on decoder models: the prompt is prefilled (no token is
sampled) and its final hidden states (after the model's last norm) are pooled
by one rule, then L2-normalized. `last` is vLLM's default for decoder models
(the last token has seen the whole prompt); `mean` averages every prompt
token's state.
"""

from __future__ import annotations

from dataclasses import dataclass

POOLING_RULES = ("last", "mean")


@dataclass(slots=True, frozen=True)
class PoolingParams:
    """A pooling request's rule; `LLMEngine.add_request` takes it instead of SamplingParams.

    `last` reads the prefix cache like any prompt (only the last token must be
    computed). `mean` needs every prompt token's state, which a cached block does
    not keep: a mean request recomputes its whole prompt (kvserve.engine.llm_engine
    gives it a cache salt of its own, so it neither reads nor duplicates shared blocks).
    """

    pooling: str = "last"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling not in POOLING_RULES:
            raise ValueError(f"pooling must be one of {POOLING_RULES}, got {self.pooling!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError("normalize must be True or False")
